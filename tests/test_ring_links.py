"""loom's TCP links for the ring: the handshake admits only a neighbour holding the job secret, bad peers are
refused without stopping the listener, a job without a secret falls back to gloo, a neighbour that exits is
named at once."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
from conftest import run_workers

from loom.comm import links
from loom.net.auth import mac

SECRET = bytes(range(32))


def _listener() -> tuple[socket.socket, int]:
    server = socket.create_server(("127.0.0.1", 0))
    return server, server.getsockname()[1]


def _accept_in_thread(server: socket.socket, secret: bytes = SECRET, seconds: float = 30.0):
    """Run the accepting side (rank 1 waiting for rank 0) in a thread; returns (thread, result dict: the
    accepted socket and the `loom.net.listener.Listener` counting the refused connections, or the error)."""
    result: dict = {}

    def run() -> None:
        try:
            deadline = time.monotonic() + seconds
            result["sock"], result["listener"] = links._accept(server, secret, 0, 1, deadline)
        except Exception as error:  # noqa: BLE001 - handed to the test
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _raw_client(port: int, payload: bytes) -> bytes:
    """Connect, send ``payload`` and end the sending side, return whatever comes back until the listener
    closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        received = b""
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(4096):
                received += chunk
        except OSError:  # the listener closed first, with some of our bytes unread (a reset)
            pass
        return received


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_handshake_admits_the_neighbour_with_the_secret():
    server, port = _listener()
    thread, result = _accept_in_thread(server)
    dialed = links._dial("127.0.0.1", port, SECRET, 0, 1, time.monotonic() + 10)
    thread.join(10)
    accepted = result["sock"]
    dialed.sendall(b"payload")
    assert accepted.recv(7) == b"payload" and result["listener"].rejected == 0
    for sock in (dialed, accepted, server):
        sock.close()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_wrong_secret_replay_and_garbage_are_refused_and_the_neighbour_still_admitted():
    server, port = _listener()
    thread, result = _accept_in_thread(server)
    with pytest.raises(RuntimeError, match="rank 0: ring link to rank 1 .* did not prove|refused"):
        links._dial("127.0.0.1", port, b"x" * 32, 0, 1, time.monotonic() + 20)  # wrong secret
    hello = links._HELLO + os.urandom(16) + (0).to_bytes(4, "big") + (1).to_bytes(4, "big")
    # a replayed connector proof: valid for another nonce of the listener, so wrong for this one
    old_nonce = os.urandom(16)
    replayed = mac(SECRET, b"loom ring connect", old_nonce, hello[8:24], hello[24:])
    assert len(_raw_client(port, hello + replayed)) == 16 + 32  # its nonce and proof, then no "accepted" byte
    _raw_client(port, os.urandom(64))  # random bytes
    _raw_client(port, links._HELLO[:5])  # truncated, then closed
    wrong_pair = links._HELLO + os.urandom(16) + (2).to_bytes(4, "big") + (1).to_bytes(4, "big")
    assert _raw_client(port, wrong_pair) == b""  # a hello from a rank that is not the neighbour: no reply
    assert thread.is_alive()  # still waiting for rank 0
    dialed = links._dial("127.0.0.1", port, SECRET, 0, 1, time.monotonic() + 20)
    thread.join(20)
    assert "sock" in result and result["listener"].rejected == 5, result
    for sock in (dialed, result["sock"], server):
        sock.close()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_silent_clients_do_not_hold_the_neighbour_back_and_are_dropped(monkeypatch):
    monkeypatch.setattr(links, "CONNECTION_TIMEOUT_S", 6.0)
    server, port = _listener()
    thread, result = _accept_in_thread(server)
    # connect, then say nothing: 13 as in the attack first reported, then more than a listener handshakes at once
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(13 + links.MAX_PENDING_HANDSHAKES)]
    time.sleep(0.2)
    dialed = links._dial("127.0.0.1", port, SECRET, 0, 1, time.monotonic() + 20)
    thread.join(20)
    assert "sock" in result, result
    # Served one after another, the neighbour would wait for 13 x 6 s of silence (longer than its 20 s); side
    # by side, it is admitted before any silent client has timed out: at most the 13 + 1 oldest were evicted to
    # make room for it (evictions are counted as their threads notice), none has reached its 6 s deadline.
    assert result["listener"].rejected <= 14, result
    for sock in silent:  # each was dropped at its own deadline
        sock.settimeout(10)
        assert sock.recv(1) == b""
    assert result["listener"].rejected == 13 + links.MAX_PENDING_HANDSHAKES, result
    for sock in (*silent, dialed, result["sock"], server):
        sock.close()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_listener_without_the_secret_is_not_trusted():
    server, port = _listener()
    thread, result = _accept_in_thread(server, secret=b"y" * 32, seconds=3)
    with pytest.raises(RuntimeError, match="rank 0: ring link to rank 1 .*(did not prove|refused)"):
        links._dial("127.0.0.1", port, SECRET, 0, 1, time.monotonic() + 20)
    thread.join(20)
    assert "did not connect and prove the job secret" in str(result["error"])
    server.close()


@pytest.mark.unit
def test_listens_on_loopback_unless_an_interface_is_named(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert links._listen_address() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert links._listen_address() == "127.0.0.1"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_without_a_job_secret_the_ring_uses_gloo():
    outputs = run_workers("ring_links.py", 3, "nosecret")
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert results == [{"correct": True, "linked": False, "rejected": None, "warnings": []}] * 3


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_process_with_another_secret_sends_the_whole_ring_through_gloo():
    outputs = run_workers("ring_links.py", 3, "other_secret")
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [(r["correct"], r["linked"]) for r in results] == [(True, False)] * 3
    # ranks 0 -> 1 -> 2 -> 0: rank 0 sees rank 1's secret differ, rank 2 sees rank 0's
    assert (
        "rank 0: ring all-reduce goes through gloo: rank 1 holds another job secret"
        in results[0]["warnings"][0]
    )
    assert (
        "rank 2: ring all-reduce goes through gloo: rank 0 holds another job secret"
        in results[2]["warnings"][0]
    )
    assert "LOOM_JOB_SECRET" in results[0]["warnings"][0] and not results[1]["warnings"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_neighbour_that_exits_is_named_at_once():
    outputs = run_workers("ring_links.py", 3, "peer_exits")
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert results[2] == {"correct": True, "linked": True, "rejected": 0, "warnings": []}
    for rank in (0, 1):
        # "At once": not after the link's 300 s idle timeout (LINK_TIMEOUT_S); a bound no load reaches.
        assert results[rank]["correct"] and results[rank]["seconds"] < 100, results[rank]
        assert f"rank {rank}: ring all-reduce" in results[rank]["error"]
    # rank 0 receives from rank 2; rank 1 sends to it, or first hears that rank 0 stopped on its error
    assert "from rank 2 failed" in results[0]["error"]
    assert "rank 2 failed" in results[1]["error"] or "from rank 0 failed" in results[1]["error"]
