"""Shared-memory messages (loom.comm.shm_channel, shm_ring) and small all-reduces (shm_small): exact results,
the choice of path per pair, no segment left behind, and a dead peer named instead of waited for forever."""

import json
import os
import time

import pytest
import torch
from conftest import run_workers

from loom.comm import shm_wait
from loom.comm.shm_channel import ShmReceiver, ShmSender
from loom.comm.shm_ring import Ring
from loom.comm.shm_segment import PREFIX, SHM_DIR


def _names_of(pids: list[int]) -> list[str]:
    return [p.name for p in SHM_DIR.glob(PREFIX + "*") if int(p.name.split("-")[2]) in pids]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_messages_and_small_all_reduces_are_exact_on_one_host(world):
    results = [json.loads(out.strip().splitlines()[-1]) for out in run_workers("comm_shm_channel.py", world)]
    for r in results:
        assert all(r["checks"].values()), r
        assert r["paths"] == {"to_next": True, "from_prev": True}, r  # one host: shared memory
        assert r["small"] and r["tp_local"], r
    assert _names_of([r["pid"] for r in results]) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_pretended_hosts_keep_the_backend_and_stay_exact():
    script = os.path.join(os.path.dirname(__file__), "workers", "comm_shm_channel.py")
    wrapper = os.path.join(os.path.dirname(__file__), "workers", "as_own_host.py")
    outs = run_workers(wrapper, 2, script)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    for r in results:
        assert all(r["checks"].values()), r
        assert r["paths"] == {"to_next": False, "from_prev": False}, r
        assert not r["small"] and not r["tp_local"], r


class _Peer:
    """A forked process that maps ``ring`` as its reader (``attach``) or stays as its writer, then waits until
    `die` is called: so the ends are made while the peer lives (they check that its pid is visible)."""

    def __init__(self, ring: Ring, attach: bool) -> None:
        ready_r, ready_w = os.pipe()
        self._die_r, self._die_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            if attach:
                Ring.attach(ring.name, ring.capacity)
            os.write(ready_w, b"1")
            os.read(self._die_r, 1)
            os._exit(0)
        os.read(ready_r, 1)
        for fd in (ready_r, ready_w, self._die_r):
            os.close(fd)

    def die(self) -> None:
        os.write(self._die_w, b"1")
        os.close(self._die_w)
        os.waitpid(self.pid, 0)


@pytest.mark.multiprocess
@pytest.mark.timeout(10)
def test_a_sender_blocked_on_a_dead_reader_names_it():
    ring = Ring.create(4096)
    peer = _Peer(ring, attach=True)
    assert not (SHM_DIR / ring.name).exists()  # the reader removed the name when it mapped the ring
    sender = ShmSender(ring, 0, 1)
    peer.die()
    ((handle, _),) = sender.send([torch.zeros(5000)])  # 20 kB through a 4 kB ring nobody reads
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=f"rank 0: shared-memory send .* rank 1 \\(pid {peer.pid}\\) exited"
    ):
        handle.wait()
    assert time.monotonic() - started < 2.0


@pytest.mark.multiprocess
@pytest.mark.timeout(10)
def test_a_receiver_waiting_for_a_dead_writer_names_it():
    ring = Ring.create(4096)
    ring.unlink()
    peer = _Peer(ring, attach=False)
    ring.words[3] = peer.pid  # as if that process had created the ring
    receiver = ShmReceiver(ring, 1, 0)
    peer.die()
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=f"rank 1: shared-memory receive of an activation .* \\(pid {peer.pid}\\)"
    ):
        receiver.recv(what="an activation message")
    assert time.monotonic() - started < 2.0


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_wait_gives_up_after_the_time_out(monkeypatch):
    monkeypatch.setattr(shm_wait, "TIMEOUT_S", 0.2)
    with pytest.raises(RuntimeError, match="rank 0: an op: waited 0 s for rank 1"):
        shm_wait.wait_until(lambda: False, me="rank 0", peer="rank 1", pid=os.getpid, what="an op")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_forged_ring_is_refused():
    ring = Ring.create(4096)
    forged = SHM_DIR / f"{PREFIX}{os.getpid()}-{12345:016x}"
    try:
        os.link(SHM_DIR / ring.name, forged)
        with pytest.raises(ValueError, match="header"):
            Ring.attach(forged.name, 4096)
        assert not forged.exists()  # refused, and its name removed all the same
        with pytest.raises(ValueError, match="not the name"):
            Ring.attach("../etc/passwd", 4096)
    finally:
        forged.unlink(missing_ok=True)
        ring.unlink()
