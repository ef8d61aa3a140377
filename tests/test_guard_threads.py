"""The step guard's building blocks on explicit groups, ranks as threads (the fast lane, `tests/threads.py`):
the replica check names the rank that drifted, and a NaN on one rank at one step (the shared fault injector)
makes every rank skip that step and only that one, ending bitwise where a one-process run that skips it ends."""

from __future__ import annotations

import copy

import pytest
import torch
from threads import run_ranks
from torch import nn
from workers.faults import Fault, Injector

from loom import comm
from loom.errors import ReplicaDesyncError
from loom.fault.desync import NonFiniteGuard, check_replicas_agree, gradients_finite, local_flag

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _make_prototype() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


_PROTOTYPE = _make_prototype()  # made here, not in the threads: torch's default generator is one per process


def _model() -> nn.Module:
    return copy.deepcopy(_PROTOTYPE)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_equal_replicas_pass_and_a_drifted_one_is_named_on_every_rank(size):
    def body(rank, group):
        model = _model()
        check_replicas_agree(model, group, step=1)  # equal: passes
        if rank == size - 1:
            with torch.no_grad():
                model[2].bias.add_(1e-6)
        try:
            check_replicas_agree(model, group, step=2)
        except ReplicaDesyncError as error:
            return str(error)
        return None

    for rank, message in enumerate(run_ranks(size, body)):
        assert message is not None, rank
        assert (
            f"replicas disagree at step 2: ranks [{size - 1}] hold parameters different from ranks "
            in message
        )
        assert f"{list(range(size - 1))}" in message and "differs in 2.bias" in message


def test_a_tie_counts_the_side_holding_rank_0_as_the_majority():
    def body(rank, group):
        model = _model()
        if rank >= 2:
            with torch.no_grad():
                model[0].weight.mul_(2)
        with pytest.raises(ReplicaDesyncError) as raised:
            check_replicas_agree(model, group)
        return str(raised.value)

    assert all("ranks [2, 3] hold parameters different from ranks [0, 1]" in m for m in run_ranks(4, body))


STEPS, LR = 4, 0.1
_DRAW = torch.Generator().manual_seed(1)
DATA = torch.randn(48, 3, generator=_DRAW), torch.randn(48, 1, generator=_DRAW)


def _share(rank: int, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s contiguous share of step ``step``'s global batch of 12 (uneven for 4 does not occur)."""
    lo, hi = (step - 1) * 12 + rank * 12 // size, (step - 1) * 12 + (rank + 1) * 12 // size
    return DATA[0][lo:hi].clone(), DATA[1][lo:hi].clone()


def _guarded_run(rank: int, group, size: int, faults: list[Fault]) -> tuple[list[torch.Tensor], list[int]]:
    """Data-parallel SGD written out with loom's guard pieces: each rank's loss and gradient flags travel in the
    same all-reduce as the gradient (summed, weighted by the share), `NonFiniteGuard.judge` decides, alike
    everywhere."""
    model, injector = _model(), Injector(rank, faults)
    guard = NonFiniteGuard(policy="skip", rank=rank)
    params = list(model.parameters())
    for step in range(1, STEPS + 1):
        x, y = _share(rank, size, step)
        injector.before_step(step, (x, y))
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y, reduction="sum") / 12  # this share's part of the mean
        loss.backward()
        grads = [p.grad for p in params]
        flags = torch.zeros(size)
        flags[rank] = local_flag(loss.detach(), grads)
        flat = comm.all_reduce(torch.cat([*(g.reshape(-1) for g in grads), flags]), "sum", "ring", group)
        summed, flags = flat[:-size], flat[-size:]
        if guard.judge(step, flags.tolist(), range(size), gradients_finite([summed])):
            continue
        with torch.no_grad():
            offset = 0
            for p in params:
                p -= LR * summed[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
    return [p.detach().clone() for p in params], guard.history


def _one_process(skip: set[int]) -> list[torch.Tensor]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(1, STEPS + 1):
        if step in skip:
            continue
        x, y = DATA[0][(step - 1) * 12 : step * 12], DATA[1][(step - 1) * 12 : step * 12]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_nan_on_one_rank_skips_that_step_on_every_rank_and_nothing_else(size):
    faults = [Fault("nan", rank=size - 1, step=2)]
    results = run_ranks(size, lambda rank, group: _guarded_run(rank, group, size, faults))
    reference = _one_process(skip={2})
    for rank, (params, skipped) in enumerate(results):
        assert skipped == [2], (rank, skipped)
        assert all(torch.isfinite(p).all() for p in params), rank
        assert all(torch.equal(p, q) for p, q in zip(params, results[0][0], strict=True)), (
            rank
        )  # bitwise alike
        for p, q in zip(params, reference, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # up to the summation order


def test_without_a_fault_no_step_is_skipped_and_the_run_equals_one_process():
    results = run_ranks(3, lambda rank, group: _guarded_run(rank, group, 3, []))
    for params, skipped in results:
        assert skipped == []
        for p, q in zip(params, _one_process(skip=set()), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
