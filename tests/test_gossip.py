"""Gossip: decentralized asynchronous averaging with one peer at a time (`loom.parallel.gossip.gossip`) over loom's
authenticated point-to-point transport (`loom.comm.peer`).

In-process: the config, the peer sequences, the parameter layout, and the transport's deadlines, late answers,
dead peers and malformed frames. Multi-process (gloo on CPU; workers in tests/workers/gossip_*.py, helpers in
gossip_common): exact pairwise averages and convergence to the initial mean with learning stopped, only
point-to-point traffic, a refused intruder, a rejoining peer, `loom.fit` checkpoints per rank, and a SIGKILLed
peer under ``loom run --on-worker-failure continue``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import WORKERS
from torch import nn

from loom.comm.peer import PeerNode
from loom.comm.peer_wire import EXCHANGE, HEADER, MAGIC, VERSION
from loom.net.handshake import dial_handshake
from loom.parallel.gossip.gossip import Gossip, GossipConfig
from loom.parallel.gossip.gossip_exchange import ParameterLayout, PeerChoice, average_into

SECRET = b"s" * 32
HEADER_BYTES = HEADER.size


# -- in-process ---------------------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("options", "named"),
    [({"peers": "star"}, "peers"), ({"every": 0}, "every"), ({"deadline_s": 0}, "deadline_s"),
     ({"retry_after": 1.5}, "retry_after"), ({"namespace": "a/b"}, "namespace")],
)  # fmt: skip
def test_config_refuses_bad_values_naming_them(options, named):
    with pytest.raises(ValueError, match=named):
        GossipConfig(**options)
    for field in dataclasses.fields(GossipConfig):  # help(Gossip) shows every option with its meaning
        assert f"    {field.name} = {field.default!r}: " in (Gossip.__doc__ or "")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_peer_sequences():
    ring = PeerChoice("ring", 1, 4)
    assert [ring.next() for _ in range(4)] == [2, 0, 2, 0]
    exponential = PeerChoice("exponential", 3, 8)  # offsets 1, 2, 4 in turn
    assert [exponential.next() for _ in range(4)] == [4, 5, 7, 4]
    assert [PeerChoice("exponential", 0, 2).next() for _ in range(2)] == [1, 1]
    random = PeerChoice("random", 2, 5, seed=7)
    drawn = [random.next() for _ in range(400)]
    assert 2 not in drawn and all(0 <= p < 5 for p in drawn)
    assert all(60 < drawn.count(p) < 140 for p in (0, 1, 3, 4)), drawn  # uniform over the others
    middle = PeerChoice("random", 2, 5, seed=7)
    for _ in range(100):
        middle.next()
    resumed = PeerChoice("random", 2, 5, seed=0)  # another seed: only the state makes it continue
    resumed.load_state_dict(middle.state_dict())
    assert [resumed.next() for _ in range(300)] == drawn[100:] and resumed.count == 400


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_layout_packs_floating_parameters_aligned_with_zero_padding():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1, bias=False).to(torch.float64))
    layout = ParameterLayout(model)
    assert [off for off, _ in layout.slots] == [0, 40, 56]  # 36 bytes of weight padded to 40, bias 12 to 16
    flat = layout.pack()
    assert flat.numel() == layout.nbytes == 80
    for i, p in enumerate(layout.params):
        assert torch.equal(layout.view(flat, i), p.detach())
    assert flat[36:40].eq(0).all() and flat[52:56].eq(0).all()
    other = ParameterLayout(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2, bias=False)))
    assert other.fingerprint != layout.fingerprint


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_pair_arithmetic_is_symmetric_and_conserves_the_sum_when_exchanges_interleave():
    def replica(seed):
        torch.manual_seed(seed)
        return ParameterLayout(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))

    a, b, c = replica(1), replica(2), replica(3)

    def total():
        return sum(torch.cat([p.detach().double().reshape(-1) for p in r.params]) for r in (a, b, c))

    # One exchange alone: both sides end with exactly (a + b) / 2, the distance is |a - b|.
    before_a = [p.detach().clone() for p in a.params]
    before_b = [p.detach().clone() for p in b.params]
    sent, theirs = a.pack(), b.pack()
    distance = average_into(b, sent, theirs, serving=True)
    assert average_into(a, theirs, sent, serving=False) == distance
    gap = torch.cat([(x.double() - y.double()).reshape(-1) for x, y in zip(before_a, before_b, strict=True)])
    assert distance == pytest.approx(float(gap.norm()), rel=1e-5)
    for pa, pb, xa, xb in zip(a.params, b.params, before_a, before_b, strict=True):
        reference = (xa + xb) / 2
        assert torch.equal(pa, reference) and torch.equal(pb, reference)
    # Interleaved: a waits for b's answer and meanwhile serves c; the sum over the three is conserved.
    before = total()
    sent = a.pack()
    mine, asked = a.pack(), c.pack()
    average_into(a, asked, mine, serving=True)  # a answers c
    average_into(c, mine, asked, serving=False)
    theirs = b.pack()
    average_into(b, sent, theirs, serving=True)  # b answers a's earlier request
    average_into(a, theirs, sent, serving=False)
    assert (total() - before).abs().max() < 1e-6


class Peer:
    """A `PeerNode` on loopback whose values are a uint8 tensor; ``serve`` answers with them (and keeps them)."""

    def __init__(self, rank: int, addresses: dict[int, str], size: int = 64, world: int = 3) -> None:
        self.values = torch.full((size,), rank + 1, dtype=torch.uint8)
        self.served: list[tuple[int, int]] = []
        self.node = PeerNode(
            rank, world, SECRET, size, 99, self.serve, lambda p, _: addresses.get(p), "127.0.0.1"
        )
        addresses[rank] = self.node.address

    def serve(self, kind, peer, theirs):
        self.served.append((kind, peer))
        return self.values.clone()


def serving(peer: Peer, requests: int) -> threading.Thread:
    """A thread pumping ``peer`` until it has served ``requests`` requests in all (at most 5 s)."""

    def pump() -> None:
        until = time.monotonic() + 5
        while len(peer.served) < requests and time.monotonic() < until:
            peer.node.pump(0.1)

    thread = threading.Thread(target=pump)
    thread.start()
    return thread


@pytest.fixture
def peers():
    addresses: dict[int, str] = {}
    made = [Peer(r, addresses) for r in range(3)]
    yield made
    for peer in made:
        peer.node.close()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_busy_peer_is_skipped_at_the_deadline_and_its_late_answer_still_applied(peers):
    a, b, _ = peers
    got = []
    started = time.monotonic()
    assert a.node.request(1, EXCHANGE, a.values, 0.3, got.append) == "late"  # b is not pumping: a long step
    # At the deadline, not before; the upper bound only rules out waiting for the peer (it never answers here).
    assert 0.3 <= time.monotonic() - started < 30
    assert got == [] and a.node.stats.late == 1
    b.node.pump(1.0)  # b's next step boundary: it answers (and would take the average)
    until = time.monotonic() + 5
    while not got and time.monotonic() < until:
        a.node.pump(0.1)
    assert len(got) == 1 and torch.equal(got[0], b.values) and b.served == [(EXCHANGE, 0)]
    assert a.node.stats.late_applied == 1 and a.node.stats.replies == 0
    server = serving(b, 2)
    assert a.node.request(1, EXCHANGE, a.values, 5.0, got.append) == "done"  # the connection is reused
    server.join()
    assert a.node.stats.dialed == 1 and len(got) == 2
    # Exact traffic: one handshake each way, two requests out and two answers back, all of 64 payload bytes.
    frame = HEADER_BYTES + 64
    assert (a.node.stats.bytes_sent, a.node.stats.bytes_received) == (64 + 2 * frame, 49 + 2 * frame)


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_a_dead_peer_is_unreachable_at_once_not_at_the_deadline(peers):
    a, b, c = peers
    server = serving(b, 1)
    assert a.node.request(1, EXCHANGE, a.values, 5.0, lambda v: None) == "done"
    server.join()
    b.node.close()  # as when its process dies: the kernel closes its sockets
    c.node.close()
    deadline_s = 40.0  # "at once" is told apart from "at the deadline" by a margin no load closes
    started = time.monotonic()
    assert (
        a.node.request(1, EXCHANGE, a.values, deadline_s, lambda v: None) == "unreachable"
    )  # open connection, closed
    assert (
        a.node.request(2, EXCHANGE, a.values, deadline_s, lambda v: None) == "unreachable"
    )  # nobody listening
    assert time.monotonic() - started < deadline_s
    assert a.node.stats.unreachable == 2 and set(a.node.errors) == {1, 2}


@pytest.mark.unit
@pytest.mark.timeout(20)
def test_malformed_frames_close_the_connection_before_anything_is_allocated(peers):
    a, _, _ = peers
    host, port = a.node.address.rsplit(":", 1)
    bad_headers = [
        HEADER.pack(MAGIC, VERSION, EXCHANGE, 0, 1, 1, 0, 99, 1 << 40),  # a 1 TiB payload declared
        HEADER.pack(MAGIC, VERSION, EXCHANGE, 0, 1, 1, 0, 98, 64),  # another model
        HEADER.pack(MAGIC, VERSION, EXCHANGE, 0, 2, 1, 0, 99, 64),  # claims to be another rank
        HEADER.pack(b"XXXX", VERSION, EXCHANGE, 0, 1, 1, 0, 99, 64),
    ]
    for count, header in enumerate(bad_headers, start=1):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            dial_handshake(sock, SECRET, (1).to_bytes(4, "big") + (0).to_bytes(4, "big"), time.monotonic() + 5,
                           b"LOOMGSP1", b"gossip")  # fmt: skip
            sock.sendall(header)
            until = time.monotonic() + 5
            while a.node.stats.dropped < count and time.monotonic() < until:
                a.node.pump(0.1)
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed by a
    assert a.served == [] and a.node.stats.dropped == 4 and a.node.stats.rejected == 0


# -- multi-process ------------------------------------------------------------------------------------------------
def _results(outputs: list[str]) -> list[dict]:
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


def _frames_match_counters(stats: dict, payload: int) -> None:
    """Every byte a node counted is a handshake or a frame it can name: no other traffic. Requests and values
    are frames of ``payload`` bytes after the header; BUSY is a bare header."""
    frame, bare = HEADER_BYTES + payload, HEADER_BYTES
    incoming = stats["served"] + stats["refused"]
    sent = 64 * stats["dialed"] + 49 * stats["accepted"] + frame * (stats["requests"] + stats["served"])
    received = 49 * stats["dialed"] + 64 * stats["accepted"] + frame * (stats["replies"] + incoming)
    assert stats["bytes_sent"] == sent + bare * stats["refused"], stats
    assert stats["bytes_received"] == received + bare * stats["busy"], stats


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_pair_averages_exactly_refuses_an_intruder_and_a_rejoining_peer_copies(workers):
    r0, r1 = _results(workers("gossip_pair.py", 2, timeout=110))
    a, b = torch.tensor(r0["initial"]), torch.tensor(r1["initial"])
    mean = (a + b) / 2  # the reference, computed here
    assert not torch.equal(a, b)
    for r in (r0, r1):
        assert torch.equal(torch.tensor(r["after_pair"]), mean), r["rank"]
        assert r["stats_pair"]["late"] == r["stats_pair"]["unreachable"] == 0
        assert r["ops"] == {"gossip": r["ops"]["gossip"]}  # loom counted no collective
    assert r0["stats_pair"]["replies"] + r1["stats_pair"]["replies"] >= 1
    # The intruder: refused by the real handshake, and its raw frame never decoded.
    assert r1["intruder"]["handshake"] == "the listener did not prove it holds the job secret"
    assert r1["intruder"]["raw_reply_bytes"] == 48  # the listener's nonce and proof, then it closed
    assert r0["stats_intruder"]["rejected"] == 2
    assert r0["stats_intruder"]["served"] == r0["stats_pair"]["served"]
    assert r0["stats_intruder"]["dropped"] == 0
    assert torch.equal(torch.tensor(r0["after_intruder"]), mean)
    # The restarted rank 1 (all 7.0) copied rank 0, then both stayed at the mean.
    assert r1["joined"]["from"] == 0 and torch.equal(torch.tensor(r1["joined"]["params"]), mean)
    assert r1["stats"]["joined_from"] == 0 and r0["stats"]["joined_from"] == -1
    for r in (r0, r1):
        assert torch.equal(torch.tensor(r["final"]), mean)
        assert len(r["losses"]) == 8


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_with_learning_stopped_replicas_converge_to_their_initial_mean_over_point_to_point_only(workers):
    results = _results(workers("gossip_spread.py", 4, "ring", "60", timeout=110))
    initial = torch.tensor([r["initial"] for r in results], dtype=torch.float64)
    final = torch.tensor([r["final"] for r in results], dtype=torch.float64)
    mean = initial.mean(0)
    assert (final.mean(0) - mean).abs().max() < 1e-6  # every exchange conserves the sum
    start = (initial - mean).norm(dim=1).max()
    assert (final - mean).norm(dim=1).max() < 1e-2 * start  # 1e-4 to 1e-7 in most runs; timing decides
    # Learning is stopped, so every exchange is a pairwise average: each replica stays in the convex hull of
    # the initial ones, and no distance between two of them can exceed the initial diameter. The estimate (the
    # distance at the last exchange with each peer) is compared with that diameter, not with the rank's own first
    # estimates: those depend on which neighbour answered first (a near one makes them small), which is timing.
    diameter = (initial[:, None] - initial[None]).norm(dim=-1).max()
    for r in results:
        spreads = r["spreads"]
        # 1e-5: the exchange measures its distance on the float32 parameters, the diameter is float64 here
        assert len(spreads) == 60 and max(spreads) <= diameter * (1 + 1e-5), (r["rank"], spreads)
        # After every rank's 60 exchanges the last one on each edge came after dozens of averaging rounds.
        assert r["stats"]["spread"] < 0.1 * diameter, (r["rank"], r["stats"]["spread"], float(diameter))
        stats = r["stats"]
        assert stats["late"] == stats["unreachable"] == stats["dropped"] == 0
        assert stats["requests"] == 60  # one exchange per step, every=1
        _frames_match_counters(stats, r["payload_bytes"])
        assert r["ops"] == {"gossip": r["ops"]["gossip"]}  # loom.comm counted gossip's traffic, nothing else
        assert r["counted"] == [stats["bytes_sent"], stats["bytes_received"]]
    assert sum(r["stats"]["bytes_sent"] for r in results) == sum(
        r["stats"]["bytes_received"] for r in results
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_fit_checkpoints_and_resumes_each_ranks_own_state(workers, tmp_path):
    results = _results(workers("gossip_fit.py", 2, str(tmp_path / "ckpt"), timeout=110))
    for r in results:
        assert r["first"] == [6, 6, None] and r["resumed"] == [6, 0, 6] and r["more"][:3] == [9, 3, 6]
        assert r["restored"] == r["saved"], r["rank"]  # parameters, momentum, step and peer choice, bitwise
    assert results[0]["saved"]["params"] != results[1]["saved"]["params"]  # each rank resumed its own replica


def _session_members(sid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[4]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


@pytest.mark.system
@pytest.mark.timeout(180)
def test_a_sigkilled_peer_is_skipped_and_the_others_train_to_the_end(tmp_path):
    # deadline_s 60: were the dead peer waited for rather than found unreachable, the test would time out; a live
    # peer's answer never takes that long, so "late" stays 0 whatever the load.
    config = {"steps": 30, "kill_rank": 1, "kill_step": 5, "slow_s": 0.02, "deadline_s": 60.0}
    command = [sys.executable, "-m", "loom.cli", "run", "-n", "3", "--on-worker-failure", "continue",
               "--run-dir", str(tmp_path / "run"), str(WORKERS / "gossip_kill.py"), json.dumps(config)]  # fmt: skip
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=170)
    finally:
        for pid in _session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "worker rank 1 was killed by SIGKILL; 2 other worker(s) go on" in err, err[-3000:]
    done = {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (tmp_path / "run").glob("gossip-*.json")
    }
    assert sorted(done) == [0, 2]
    for rank, r in done.items():
        assert r["steps"] == 30 and len(r["losses"]) == 30, rank
        stats = r["stats"]
        assert stats["unreachable"] >= 1 and stats["late"] == 0, (
            stats
        )  # found dead at once, not at the deadline
        # The schedule, not the speeds: 30 exchanges, the ring alternating the two neighbours (a passed-over dead
        # peer hands its turn to the other), so at least 15 go to the other survivor, which answers every one
        # (it serves until both have finished; late is 0) with its values or, when both asked at once, BUSY.
        assert stats["replies"] + stats["busy"] >= 15, stats
        print(f"rank {rank}: {stats['replies']} replies, {stats['busy']} busy, {r['elapsed']:.1f} s")
        assert r["losses"][-1] < r["losses"][0]
    # Of two requests that cross, exactly one is served: at least one exchange per two of those attempts.
    assert sum(r["stats"]["replies"] for r in done.values()) >= 15, [r["stats"] for r in done.values()]
    # The step records carry the spread between replicas, and `loom report` shows its last value per rank.
    from loom.observe.report import load_records, summarize

    records = load_records(tmp_path / "run")
    assert all(r.get("spread") is not None for rank in (0, 2) for r in records[rank])
    spreads = {row["rank"]: row["last_spread"] for row in summarize(records, None)["ranks"]}
    assert spreads[0] == records[0][-1]["spread"] and spreads[0] >= 0.0
