"""The small-message path of loom.comm.shm_channel (header caches, the one-copy send, the header taken from the
ring) and loom.comm.shm_spin's spin budget: exact messages of every shape through a ring small enough to wrap
and overflow, in one process (the receiver's waits push the sender's queue), and the budget's rules."""

import pytest
import torch

from loom.comm import shm_spin, shm_wait
from loom.comm.shm_channel import ShmReceiver, ShmSender
from loom.comm.shm_ring import Ring


def _message(k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    kinds = [
        lambda: [torch.randn(1024, generator=g)],  # 4 KiB, the benchmark's message, repeated: cached header
        lambda: [torch.randn(3, 5, generator=g), torch.randint(-9, 9, (7,), generator=g, dtype=torch.int8)],
        lambda: [torch.randn(5, generator=g).to(torch.bfloat16), torch.tensor(k % 2 == 0), torch.empty(0, 4)],
        lambda: [torch.randn(4, 6, generator=g).t()],  # not contiguous
        lambda: [torch.randn(3000, generator=g)],  # 12 kB: larger than the ring, streams through it
        lambda: [torch.arange(k % 13, dtype=torch.int16)],  # odd byte counts: headers land unaligned, wrap
        lambda: [],
    ]
    return kinds[k % len(kinds)]()


def _pair(capacity: int) -> tuple[ShmSender, ShmReceiver]:
    ring = Ring.create(capacity)
    reader = Ring.attach(ring.name, capacity)  # removes the name
    return ShmSender(ring, 0, 1), ShmReceiver(reader, 1, 0)


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("ahead", [1, 3])
def test_messages_of_every_kind_arrive_exactly_through_a_wrapping_ring(ahead):
    sender, receiver = _pair(4096)
    sent = []
    for k in range(120):
        message = _message(k)
        sent.append([t.clone() for t in message])
        handles = sender.send(message)
        if sender.flush():  # all in the ring (as an isend, a queued tensor must stay as it is until waited)
            for t in message:
                t.zero_()
        if len(sent) >= ahead:
            got = receiver.recv(what="a test message")
            want = sent.pop(0)
            assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want], k
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), k
        for handle, _ in handles:
            if not sent:
                handle.wait()
    while sent:
        got, want = receiver.recv(), sent.pop(0)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert sender.flush() and not receiver.ring.readable()


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_header_split_by_a_full_ring_is_read_as_it_comes():
    sender, receiver = _pair(4096)
    first = torch.arange(4096 - 40 - 12, dtype=torch.uint8)  # with its 40-byte header: 12 bytes left free
    second = torch.randn(5)
    sender.send([first])
    sender.send([second])  # 12 bytes of its header fit, the rest is queued
    assert not sender.flush()
    assert torch.equal(receiver.recv()[0], first)
    assert torch.equal(receiver.recv()[0], second)  # the receiver's wait pushes the sender's queue


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_corrupt_header_is_refused_by_name():
    sender, receiver = _pair(4096)
    sender.ring.words[0] = sender.ring.words[0]  # untouched header page
    bad = torch.tensor([3, 1, 99, 0], dtype=torch.int64)  # 3 words: 1 tensor of dtype code 99
    sender.ring.put(bad.data_ptr(), bad.nbytes)
    sender.ring.publish()
    with pytest.raises(RuntimeError, match="rank 1: corrupt message header from rank 0 \\(dtype code 99\\)"):
        receiver.recv()


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_spin_budget_grows_with_quick_answers_and_shrinks_with_slow_ones(monkeypatch):
    assert shm_spin.SPIN_MAX_S == shm_wait.SPIN_S  # the default: a fixed spin (the module docstring says why)
    monkeypatch.setattr(shm_spin, "SPIN_MAX_S", 200e-6)
    monkeypatch.setattr(shm_spin, "cpu_contended", lambda: False)
    budget = shm_spin.SpinBudget()
    assert budget.seconds == shm_wait.SPIN_S and budget.spin() == shm_wait.SPIN_S
    budget.update(shm_wait.SPIN_S / 2)  # caught spinning: nothing to learn
    assert budget.seconds == shm_wait.SPIN_S
    budget.update(60e-6)  # slept, but the answer came soon: spin that long twice over next time
    assert budget.seconds == pytest.approx(120e-6) and budget.spin() == pytest.approx(120e-6)
    budget.update(150e-6)
    assert budget.seconds == shm_spin.SPIN_MAX_S
    budget.update(10e-3)  # the peer computed for milliseconds: halve, down to SPIN_S
    assert budget.seconds == pytest.approx(shm_spin.SPIN_MAX_S / 2)
    for _ in range(10):
        budget.update(10e-3)
    assert budget.seconds == shm_wait.SPIN_S
    budget.update(100e-6)
    monkeypatch.setattr(shm_spin, "cpu_contended", lambda: True)
    assert budget.seconds == pytest.approx(200e-6) and budget.spin() == shm_wait.SPIN_S  # a contended CPU


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_contention_is_the_share_of_runnable_time_spent_waiting_for_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_spin, "CHECK_EVERY_S", 0.0)
    stat = tmp_path / "schedstat"
    contention = shm_spin._Contention(str(stat))
    assert contention.check()  # no such file: contended, the short spin for good
    contention = shm_spin._Contention(str(stat))
    stat.write_text("50000000 1000000 7\n")  # ran 50 ms, waited 1 ms: 2 %
    assert not contention.check()
    stat.write_text("50100000 1010000 8\n")  # 0.11 ms more: too little to tell, the last verdict stands
    assert not contention.check()
    stat.write_text("52100000 3010000 9\n")  # ran 2 ms, waited 2 ms: 50 %
    assert contention.check()
    stat.write_text("62100000 3110000 9\n")  # ran 10 ms, waited 0.1 ms
    assert not contention.check()
    assert isinstance(shm_spin.cpu_contended(), bool)  # this process's own counters parse
