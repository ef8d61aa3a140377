"""loom.comm's collectives on explicit groups, ranks as threads (the fast lane, `tests/threads.py`): each result
against a hand computation over every rank's input, world sizes 2-4, lengths that divide unevenly."""

from __future__ import annotations

import pytest
import torch
from threads import run_ranks

from loom import comm
from loom.comm import ring
from loom.comm.shards import piece_bounds

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SIZES = (2, 3, 4)
# 0 and 1 element, a length no world size divides, and one past the two-member exchange's bound (ring segments).
LENGTHS = (0, 1, 7, 1001, ring.EXCHANGE_BELOW_BYTES // 4 + 5)


def _input(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s tensor: small integers, so every summation order gives the same bits."""
    values = (torch.arange(numel, dtype=torch.int64) * (rank + 3) + 5 * rank) % 97 - 40
    return values.to(dtype)


def _by_hand(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(tensors)
    if op == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if op == "avg":
        return stacked.sum(0) / len(tensors)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


@pytest.mark.parametrize("algorithm", ["native", "ring", "driver"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_equals_the_hand_computation(size, op, algorithm):
    for numel in LENGTHS:
        if numel > 1001 and op in ("max", "min"):
            continue  # the long tensor is there for the ring's segments; sum and avg cover them

        def body(rank, group, numel=numel):
            return comm.all_reduce(_input(rank, numel), op=op, algorithm=algorithm, group=group)

        results = run_ranks(size, body)
        expected = _by_hand(op, [_input(r, numel) for r in range(size)])
        for rank, got in enumerate(results):
            assert torch.equal(got, expected), (size, op, algorithm, numel, rank)


@pytest.mark.parametrize("algorithm", ["native", "ring", "driver"])
def test_all_reduce_of_integers_and_doubles_and_a_strided_view(algorithm):
    def body(rank, group):
        ints = comm.all_reduce(_input(rank, 11, torch.int64), op="sum", algorithm=algorithm, group=group)
        doubles = comm.all_reduce(_input(rank, 11, torch.float64), op="avg", algorithm=algorithm, group=group)
        matrix = _input(rank, 12).reshape(3, 4)
        column = comm.all_reduce(matrix[:, 1], op="sum", algorithm=algorithm, group=group)  # not contiguous
        return ints, doubles, column, matrix

    results = run_ranks(3, body)
    for rank, (ints, doubles, column, matrix) in enumerate(results):
        assert torch.equal(ints, _by_hand("sum", [_input(r, 11, torch.int64) for r in range(3)])), rank
        assert torch.equal(doubles, _by_hand("avg", [_input(r, 11, torch.float64) for r in range(3)])), rank
        expected = _by_hand("sum", [_input(r, 12).reshape(3, 4)[:, 1] for r in range(3)])
        assert torch.equal(column, expected) and torch.equal(matrix[:, 1], expected), rank  # written back


def test_all_reduce_of_random_floats_matches_up_to_summation_order():
    inputs = [torch.randn(513, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    for algorithm in ("native", "ring", "driver"):
        results = run_ranks(
            4, lambda rank, group, a=algorithm: comm.all_reduce(inputs[rank].clone(), "avg", a, group)
        )
        for got in results:
            torch.testing.assert_close(got, torch.stack(inputs).mean(0), rtol=1e-6, atol=1e-6)


def test_ring_over_loom_links_equals_the_hand_computation(monkeypatch):
    """With a job secret the ring runs over loom's own TCP links (made on the group's first ring call)."""
    monkeypatch.setenv("LOOM_JOB_SECRET", "ab" * 32)
    numel = 3 * ring.EXCHANGE_BELOW_BYTES // 4 + 1
    results = run_ranks(3, lambda rank, group: comm.all_reduce(_input(rank, numel), "sum", "ring", group))
    expected = _by_hand("sum", [_input(r, numel) for r in range(3)])
    assert all(torch.equal(got, expected) for got in results)


def test_ring_and_driver_bytes_are_counted_exactly():
    numel, size = 60, 4  # float32: 240 bytes, divisible by every size
    for algorithm, per_rank in (
        ("ring", [2 * (size - 1) * 240 // size] * size),
        ("driver", [3 * 240, 240, 240, 240]),
    ):
        comm.counters().reset()
        run_ranks(
            size, lambda rank, group, a=algorithm: comm.all_reduce(_input(rank, numel), "sum", a, group)
        )
        counted = comm.counters().snapshot()  # one process: the four ranks' records add up
        assert counted["bytes_sent"] == sum(per_rank) == counted["bytes_received"], (algorithm, counted)
        assert counted["ops"] == {algorithm: size}, counted


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter_gives_each_rank_its_piece_of_the_hand_sum(size, op):
    for numel in (0, 1, 2, 7, 1001):
        results = run_ranks(
            size, lambda rank, group, n=numel: comm.reduce_scatter(_input(rank, n), op, group)
        )
        whole = _by_hand(op, [_input(r, numel) for r in range(size)])
        for rank, piece in enumerate(results):
            lo, hi = piece_bounds(numel, rank, size)
            assert torch.equal(piece, whole[lo:hi]), (size, op, numel, rank)


@pytest.mark.parametrize("size", SIZES)
def test_all_gather_reassembles_every_ranks_piece(size):
    for numel in (0, 1, 2, 7, 1001):
        whole = _input(7, numel)

        def body(rank, group, numel=numel, whole=whole):
            lo, hi = piece_bounds(numel, rank, size)
            return comm.all_gather(whole[lo:hi].clone(), numel, group)

        assert all(torch.equal(got, whole) for got in run_ranks(size, body)), (size, numel)


def test_reduce_scatter_then_all_gather_is_the_all_reduce():
    def body(rank, group):
        flat = _input(rank, 1001, torch.float64)
        halves = comm.all_gather(comm.reduce_scatter(flat, "avg", group), 1001, group)
        return halves, comm.all_reduce(flat.clone(), "avg", "native", group)

    for halves, whole in run_ranks(3, body):
        assert torch.equal(halves, whole)


def test_a_wrong_piece_names_the_rank_and_the_sizes():
    def body(rank, group):
        if rank == 1:
            comm.all_gather(torch.zeros(5), 10, group)  # rank 1 of 2 holds 5 of 10: fine
            return comm.all_gather(
                torch.zeros(4), 10, group
            )  # refused before any message: rank 0 is not left waiting
        comm.all_gather(torch.zeros(5), 10, group)
        return None

    with pytest.raises(
        AssertionError,
        match="rank 1 of 2 raised ValueError: all_gather: rank 1's piece of a "
        "10-element tensor over 2 ranks has 5 elements",
    ):
        run_ranks(2, body)


def test_a_group_of_one_is_a_no_op_and_counts_nothing_sent():
    comm.counters().reset()
    got = run_ranks(1, lambda rank, group: comm.all_reduce(torch.ones(3), "sum", "ring", group))
    assert torch.equal(got[0], torch.ones(3)) and comm.counters().snapshot()["bytes_sent"] == 0


@pytest.mark.parametrize("size", [2, 3])
def test_broadcast_module_gives_every_rank_rank_0s_tensors_bitwise_in_their_own_dtypes(size, monkeypatch):
    from torch import nn

    from loom.parallel.pipeline import pipeline_stages

    # packed buckets and in-place sends both
    monkeypatch.setattr(pipeline_stages, "BROADCAST_BUCKET_BYTES", 64)

    def build(rank: int) -> nn.Module:  # each rank's own values (a thread's own generator: no shared seed)
        generator = torch.Generator().manual_seed(rank)
        model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3).half(), nn.BatchNorm1d(3))
        model.register_buffer("strided", torch.empty(4, 6).t())  # not contiguous
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=generator))
        model[2].num_batches_tracked.fill_(2**53 + 1 + rank)  # inexact as a float64
        return model

    def body(rank, group):
        model = build(rank)
        pipeline_stages.broadcast_module(model, group)
        return model.state_dict()

    expected = build(0).state_dict()
    for rank, got in enumerate(run_ranks(size, body)):
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (rank, name)
