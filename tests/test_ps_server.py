"""A live server under attack, sparse rows by byte counters, and a server killed and restarted from its checkpoint.

Two servers (payload limit 1 MiB, a checkpoint directory) serve the whole module; the worker side runs in this
test process (one worker), so only the servers are separate processes.
"""

import contextlib
import hashlib
import hmac
import itertools
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from ps_helpers import parameter_servers
from torch import nn
from workers.common import make_dataset, make_mlp, make_optimizer, reference_run

import loom
from loom.parallel.ps.parameter_server import ParameterServer
from loom.ps.client import PSClient
from loom.ps.gate import chunk_key, secure_client, split_frame
from loom.ps.wire import HEADER, MessageType, decode, encode, secret_from_hex
from loom.topology import Topology

SINGLE = Topology(0, 1, 0, 1, "none")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ps-checkpoints")
    with parameter_servers(2, "--max-payload-mb", "1", "--checkpoint-dir", str(directory)) as running:
        running.checkpoint_dir = directory
        yield running


def stats(servers, index: int = 0) -> dict:
    client = PSClient([servers.addresses[index]], secret_from_hex(servers.secret))
    try:
        client.hello()
        return client.request(MessageType.STATS, [{}], timeout_s=30)[0].meta
    finally:
        client.close()


def dealer(address: str, secret: bytes | None) -> zmq.Socket:
    """A raw ZeroMQ client; it presents the connection token of ``secret`` (None: it presents none)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        secure_client(sock, secret, address)
    sock.connect(f"tcp://{address}")
    return sock


def send(sock: zmq.Socket, data: bytes, secret: bytes) -> None:
    """``data`` as the chunks a client with ``secret`` sends (`loom.ps.gate.split_frame`)."""
    for chunk in split_frame(chunk_key(secret), data):
        sock.send(chunk)


def answered(sock: zmq.Socket, timeout_ms: int = 250) -> bytes | None:
    """The frame of the first answer (chunks reassembled), or None."""
    chunks = []
    while sock.poll(timeout_ms):
        chunks.append(sock.recv())
        count = int.from_bytes(chunks[0][12:16], "little")
        if len(chunks) == count:
            return b"".join([chunks[0][48:], *(c[16:] for c in chunks[1:])])
    return None


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_attacks_are_dropped_counted_and_survived(servers):
    secret = secret_from_hex(servers.secret)
    address = servers.addresses[0]
    stats(servers)  # the server is up
    # 1. a client without the secret gets no answer at all: its connection is refused at the handshake
    stranger = PSClient([address], os.urandom(32))
    with pytest.raises(TimeoutError, match="did not answer HELLO"):
        stranger.hello(timeout_s=1.0)
    stranger.close()
    # ... and a client with the connection token but frames signed with another key is dropped frame by frame
    sock = dealer(address, secret)
    key = os.urandom(32)
    send(sock, encode(key, MessageType.HELLO, epoch=0, session=98, seq=1), key)
    assert answered(sock) is None
    # 2. replays: a valid frame sent twice, and again on a new connection, is answered once
    send(sock, encode(secret, MessageType.HELLO, epoch=0, session=99, seq=1), secret)
    epoch = decode(secret, answered(sock, 10_000)).epoch
    request = encode(secret, MessageType.STATS, epoch=epoch, session=99, seq=2)
    send(sock, request, secret)
    assert answered(sock, 10_000) is not None
    send(sock, request, secret)
    assert answered(sock) is None
    other = dealer(address, secret)
    send(other, request, secret)
    send(other, encode(secret, MessageType.STATS, epoch=epoch + 1, session=99, seq=3), secret)  # wrong epoch
    assert answered(other) is None
    # 3. lengths: a header declaring a terabyte, one declaring more than arrived, a message over the limit
    fields = list(HEADER.unpack_from(request))
    fields[-1] = 1 << 40
    send(sock, HEADER.pack(*fields) + request[HEADER.size :], secret)
    fields[-1] = 1000
    send(sock, HEADER.pack(*fields) + request[HEADER.size :], secret)
    big = dealer(address, secret)
    big.send(b"\0" * (3 << 20))  # over ZeroMQ's maxmsgsize: the connection is dropped before a byte is kept
    # 4. random bytes, as ZeroMQ messages and as raw TCP
    for n in (0, 7, 200, 5000):
        sock.send(os.urandom(n))
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(os.urandom(4096))
        time.sleep(0.2)
    assert answered(sock) is None and answered(big, 10) is None
    # the server is alive, answers a real client, counted every reason, and allocated nothing large
    dropped = stats(servers)["wire"]["dropped"]
    for reason, least in (
        ("bad_handshake", 1),
        ("bad_mac", 1),
        ("replay", 2),
        ("stale_epoch", 1),
        ("oversized", 1),
        ("truncated", 1),
    ):
        assert dropped.get(reason, 0) >= least, (reason, dropped)
    assert dropped.get("malformed", 0) >= 4  # random messages are not chunks
    status = Path(f"/proc/{servers.procs[0].pid}/status").read_text().splitlines()
    rss_kb = int(next(line for line in status if line.startswith("VmRSS")).split()[1])
    assert rss_kb < 1_000_000
    for s in (sock, other, big):
        s.close(0)


@pytest.mark.multiprocess
@pytest.mark.timeout(30)
def test_servers_listen_on_loopback_only(servers):
    inodes = set()
    for pid in (p.pid for p in servers.procs):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except FileNotFoundError:  # closed since the listing (a connection of an earlier test)
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes and cols[3] == "0A":  # state LISTEN
                listening.append(cols[1].split(":")[0])
    assert len(listening) == 2 and set(listening) == {"0100007F"}, listening


def sparse_model(rows: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(rows, 8, sparse=True), nn.Flatten(), nn.Linear(24, 1))


def sparse_batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    touched = torch.tensor([1, 7, rows // 2 - 1, rows // 2 + 2, rows - 2, rows - 1])  # rows on both servers
    g = torch.Generator().manual_seed(seed)
    ids = touched[torch.randint(0, len(touched), (5, 3), generator=g)]
    return ids, torch.randn(5, 1, generator=g)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_sparse_rows_move_bytes_in_touched_rows_not_table_size(servers):
    per_step = {}
    for rows in (500, 20_000):
        model = sparse_model(rows)
        job = ParameterServer(
            topology=SINGLE,
            addresses=tuple(servers.addresses),
            secret=servers.secret,
            namespace=f"sparse-{rows}",
        ).setup(  # fmt: skip
            model, torch.optim.SGD(model.parameters(), lr=0.05), nn.functional.mse_loss
        )
        assert {p.server for p in job.plan if p.sparse} == {0, 1}  # the table is split across the servers
        reference = sparse_model(rows)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
        for step in range(3):
            before = job.client.bytes_moved()
            job.train_step(sparse_batch(rows, step))
            per_step[rows] = job.client.bytes_moved() - before
            ref_opt.zero_grad()
            nn.functional.mse_loss(
                reference(sparse_batch(rows, step)[0]), sparse_batch(rows, step)[1]
            ).backward()
            ref_opt.step()
        final = job.state_dict()["model"]
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(final[name], value, atol=1e-5, rtol=1e-5)
        job.close()
    assert abs(per_step[20_000] - per_step[500]) <= 64, per_step  # 40x the table, the same traffic
    assert per_step[20_000] < 0.05 * 20_000 * 8 * 4, per_step  # a small fraction of the table's bytes


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_restarted_server_resumes_from_its_checkpoint(servers):
    data = make_dataset()
    model = make_mlp()
    job = ParameterServer(
        topology=SINGLE,
        addresses=(servers.addresses[1],),
        secret=servers.secret,
        namespace="restart",
        checkpoint_every=1,
    ).setup(  # fmt: skip
        model, make_optimizer("sgd", model), nn.functional.mse_loss
    )
    loader = loom.data.loader(data, 10, seed=1, topology=SINGLE)
    batches = itertools.chain(loader, loader)  # epoch 0, then epoch 1, as reference_run
    losses = [job.train_step(next(batches)) for _ in range(3)]
    servers.kill(1)  # SIGKILL: no goodbye, no final save; the checkpoint of update 3 is on disk
    servers.start(1)
    losses += [job.train_step(next(batches)) for _ in range(3)]
    assert "resumed model 'restart' at version 3" in servers.log(1)
    ref_losses, ref_params = reference_run("sgd", 10, 6)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    final = job.state_dict()["model"]
    for name, ref in ref_params.items():
        torch.testing.assert_close(final[name], ref, atol=1e-6, rtol=0)
    # The JSON and the one tensors file it names (each save has its own name; the older ones are gone).
    saved = sorted(p.name for p in (servers.checkpoint_dir / "server1").glob("restart.*"))
    assert len(saved) == 2 and saved[0] == "restart.json", saved
    assert re.fullmatch(r"restart\.v6\.[0-9a-f]{8}\.safetensors", saved[1]), saved
    job.close()


@pytest.mark.unit
def test_hmac_is_what_the_wire_says():
    data = encode(b"k" * 32, MessageType.BYE, epoch=1, session=2, seq=3)
    assert data[-32:] == hmac.new(b"k" * 32, data[:-32], hashlib.sha256).digest()


def _rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS")).split()[1])


def _flood(port: int, mechanism: bytes, megabytes: int) -> None:
    """A ZeroMQ greeting (NULL or PLAIN, no valid token), then a frame declaring ``megabytes`` MiB, all sent."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" * 32)
        if mechanism == b"NULL":  # NULL needs only a READY command to get past its handshake
            body = b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
            raw.sendall(bytes([0x04, len(body)]) + body)
        raw.sendall(b"\x02" + (megabytes << 20).to_bytes(8, "big"))
        chunk = b"\0" * (1 << 20)
        for _ in range(megabytes):
            raw.sendall(chunk)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_partial_frames_from_clients_without_the_token_are_not_buffered(servers):
    """20 connections, each sending a 200 MiB frame after a NULL or PLAIN greeting: before connections were
    authenticated, ZeroMQ buffered each frame whole (2.2 GB for 20 such frames, measured on a bare ROUTER)."""
    pid, port = servers.procs[0].pid, int(servers.addresses[0].rsplit(":", 1)[1])
    stats(servers)
    idle = _rss_kb(pid)
    threads = [
        threading.Thread(target=_flood, args=(port, b"NULL" if i % 2 else b"PLAIN", 200), daemon=True)
        for i in range(20)
    ]
    for t in threads:
        t.start()
    peak = idle
    while any(t.is_alive() for t in threads):
        peak = max(peak, _rss_kb(pid))
        time.sleep(0.02)
    peak = max(peak, _rss_kb(pid))
    print(
        f"server RSS idle {idle / 1024:.0f} MiB, peak under 20 x 200 MiB partial frames {peak / 1024:.0f} MiB"
    )
    assert peak < 2 * idle, (idle, peak)
    assert stats(servers)["wire"]["dropped"].get("bad_handshake", 0) >= 1  # still serving, refusals counted
