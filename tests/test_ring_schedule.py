"""loom.comm.ring's pipelined schedule, checked without processes: a lockstep simulation of every rank, the
window's safety (nothing in flight is written while it is being sent or received), and the condition that lets
all-gather receives be posted ahead of the window; the two-process exchange."""

import itertools

import pytest
import torch

from loom.comm.ring import Transfer, exchange_schedule, ring_schedule

pytestmark = pytest.mark.unit

CASES = list(itertools.product([2, 3, 4], [0, 1, 3, 1000, 1001], [16, 64, 1 << 20], [1, 2, 3]))


def _simulate(inputs: list[torch.Tensor], op: str, segment_bytes: int, window: int) -> list[torch.Tensor]:
    """Run every rank's transfers in lockstep: transfer k of rank r delivers into transfer k of rank r+1."""
    n = len(inputs)
    flats = [t.clone() for t in inputs]
    schedules = [
        ring_schedule(flats[r], r, n, segment_bytes=segment_bytes, window=window)[0] for r in range(n)
    ]
    assert len({len(s) for s in schedules}) == 1
    for k in range(len(schedules[0])):
        payloads = [schedules[r][k].send.clone() for r in range(n)]
        for r in range(n):
            incoming = schedules[(r + 1) % n][k].recv
            assert incoming.numel() == payloads[r].numel(), (r, k)
            incoming.copy_(payloads[r])
        for r in range(n):
            t = schedules[r][k]
            if t.reduce_into is not None:
                t.reduce_into.add_(t.recv) if op == "sum" else torch.maximum(
                    t.reduce_into, t.recv, out=t.reduce_into
                )
    return flats


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("n", "numel", "segment_bytes", "window"), CASES)
def test_lockstep_ring_reduces_everywhere(n, numel, segment_bytes, window):
    inputs = [
        torch.randn(numel, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(n)
    ]
    for op, want in (("sum", torch.stack(inputs).sum(0)), ("max", torch.stack(inputs).amax(0))):
        for got in _simulate(inputs, op, segment_bytes, window):
            torch.testing.assert_close(got, want)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_bytes_are_two_n_minus_one_over_n(n):
    flat = torch.zeros(1200, dtype=torch.float32)  # divisible by 2, 3, 4; 64-byte segments: many per chunk
    transfers, _ = ring_schedule(flat, 0, n, segment_bytes=64)
    assert sum(t.send.nbytes for t in transfers) == 2 * (n - 1) * flat.nbytes // n
    assert sum(t.recv.nbytes for t in transfers) == 2 * (n - 1) * flat.nbytes // n
    assert len(transfers) > 2 * (n - 1)  # really segmented


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.nbytes


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1


def _written(t: Transfer) -> list[torch.Tensor]:
    return [t.recv] + ([t.reduce_into] if t.reduce_into is not None else [])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("n", "numel", "segment_bytes", "window"), CASES)
def test_window_never_touches_buffers_in_flight(n, numel, segment_bytes, window):
    """`run_ring` posts transfer j once every transfer before j - window + 1 is finished (all-gather receives
    go earlier: see the next test). So while j is in flight, transfers j - window + 1 .. j + window - 1 may be
    too: none of them may write what another reads."""
    for rank in range(n):
        flat = torch.zeros(numel, dtype=torch.float32)
        transfers, w = ring_schedule(flat, rank, n, segment_bytes=segment_bytes, window=window)
        for j, later in enumerate(transfers):
            for i in range(max(0, j - w + 1), j):
                earlier = transfers[i]
                for written in _written(later):  # j is posted while i may be unfinished
                    assert not _overlap(written, earlier.send), (rank, i, j)
                    assert not _overlap(written, earlier.recv), (rank, i, j)
                for written in _written(earlier):  # i is reduced while j is in flight
                    assert not _overlap(written, later.send), (rank, i, j)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("n", "numel", "segment_bytes", "window"), CASES)
def test_all_gather_receives_can_be_posted_ahead(n, numel, segment_bytes, window):
    """`run_ring` posts an all-gather receive long before its turn. Safe because the data for it only exists
    once the segment is fully reduced, which takes this rank's contribution: so this rank's last use of the
    region before the receive must be *sending* it (after every reduction into it), and no earlier transfer
    may still reduce into it or receive into it afterwards."""
    for rank in range(n):
        flat = torch.zeros(numel, dtype=torch.float32)
        transfers, _ = ring_schedule(flat, rank, n, segment_bytes=segment_bytes, window=window)
        for j, gather in enumerate(transfers):
            if gather.reduce_into is not None or gather.recv.numel() == 0:
                continue
            touching = [
                i
                for i in range(j)
                if _overlap(transfers[i].send, gather.recv)
                or any(_overlap(w, gather.recv) for w in _written(transfers[i]))
            ]
            assert touching, (rank, j)  # every all-gathered segment was first sent by this rank
            last = transfers[touching[-1]]
            assert _overlap(last.send, gather.recv), (rank, j)
            assert not any(_overlap(w, gather.recv) for w in _written(last)), (rank, j)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("numel", [0, 1, 1000, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_two_process_exchange_gives_both_the_same_bits(numel, dtype):
    """One transfer each way of the whole tensor (the ring's D bytes per process for N = 2), then each process
    combines the other's tensor into its own: a + b on one, b + a on the other, equal to the last bit."""
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(2)]
    flats = [t.clone() for t in inputs]
    schedules = [exchange_schedule(flat)[0] for flat in flats]
    assert [len(s) for s in schedules] == [1, 1]
    (a,), (b,) = schedules
    assert a.send.nbytes == a.recv.nbytes == inputs[0].nbytes and a.divide
    payloads = [a.send.clone(), b.send.clone()]
    a.recv.copy_(payloads[1])
    b.recv.copy_(payloads[0])
    for t in (a, b):
        t.reduce_into.add_(t.recv)
    assert torch.equal(flats[0], flats[1])
    torch.testing.assert_close(flats[0], inputs[0] + inputs[1])
