"""A deeper MLP for pipeline and hybrid tests, and its single-process reference run."""

from __future__ import annotations

import torch
from torch import nn

try:  # imported by worker scripts (tests/workers on the path) and by tests (as workers.pp_common)
    from common import make_dataset, make_optimizer
except ImportError:
    from workers.common import make_dataset, make_optimizer

from loom.data import GlobalBatchSampler


def make_deep_mlp() -> nn.Sequential:
    """Seven layers (four with parameters), so four pipeline stages can each hold a Linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 4),
    )


def deep_reference(optimizer: str, global_batch: int, steps: int, seed: int = 1):
    """Losses and final parameters of one process training `make_deep_mlp` on whole global batches."""
    data = make_dataset()
    model = make_deep_mlp()
    opt = make_optimizer(optimizer, model)
    sampler = GlobalBatchSampler(len(data), global_batch, seed=seed)
    losses: list[float] = []
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
