"""Models, data and a single-process reference shared by worker scripts and the tests that check them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from loom.data import GlobalBatchSampler

N_SAMPLES = 37  # not divisible by any batch size used in the tests


def make_dataset(n: int = N_SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 4, generator=g)
    return TensorDataset(x, y)


def least_squares(n: int = 256) -> TensorDataset:
    """The parameter-server tests' problem: ``y = x w + noise`` with 8 features, seeded (the same everywhere)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=g))


def train_steps(job, loader, steps: int, before_step: Callable[[int], None] | None = None) -> list[float]:
    """``steps`` calls of ``job.train_step`` over ``loader`` (epochs repeated), ``before_step(step)`` before each
    (a test's kill or sleep); the losses."""
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            if before_step is not None:
                before_step(len(losses))
            losses.append(job.train_step(batch))
            if len(losses) == steps:
                break
    return losses


def judged_stragglers(job, is_main: bool, timeout_s: float = 30.0):
    """The job's straggler watch once rank 0 has judged every rank's window through the job's last step (it judges
    on its watchdog thread every `loom.observe.straggler_watch.JUDGE_EVERY_S`; waited for, at most ``timeout_s``),
    then a barrier (the other ranks' watchdogs publish their last rows meanwhile). Every rank calls it."""
    import time

    import torch.distributed as dist

    watch = job._straggler_watch()
    assert watch is not None, "no straggler watch: is the watchdog's store missing?"
    deadline = time.monotonic() + timeout_s
    while is_main and watch.judged_steps < job.step and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    return watch


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    raise ValueError(name)


def reference_run(optimizer: str, global_batch: int, steps: int, seed: int = 1):
    """One process, whole global batches: the losses and final parameters a distributed run must match."""
    data = make_dataset()
    model = make_mlp()
    opt = make_optimizer(optimizer, model)
    sampler = GlobalBatchSampler(len(data), global_batch, seed=seed)
    losses = []
    while len(losses) < steps:
        for batch in sampler:
            x, y = data[batch.indices]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
