"""The GPU lane's model, data, strategies and one-process CPU reference (tests/test_gpu.py, workers/gpu_train.py).

float64 throughout, plain SGD (so LocalSGD with ``sync_every=1`` equals one process: averaging parameters after
a linear step is averaging gradients), a model of Linear-Tanh-Linear pairs (what ``TensorParallel`` splits)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import loom


def make_model(device: str | torch.device = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    model = model.to(device=device, dtype=torch.float64)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(96, 8, generator=g, dtype=torch.float64),
                         torch.randn(96, 4, generator=g, dtype=torch.float64))  # fmt: skip


STRATEGIES = {
    "dp": lambda: loom.DataParallel(),
    "localsgd": lambda: loom.LocalSGD(sync_every=1),
    "ps": lambda: loom.ParameterServer(mode="sync"),
    "tp": lambda: loom.TensorParallel(size=2),
    "hybrid": lambda: loom.Hybrid(dp=2, tp=2),
    "pipeline": lambda: loom.Pipeline(stages=2, microbatches=2),
    "sharded": lambda: loom.ShardedDataParallel(stage=1),
}


def reference_losses(steps: int, device: str = "cpu") -> list[float]:
    """One process on ``device`` (the CPU unless told): the losses of the same global batches."""
    model, optimizer = make_model(device)
    one = loom.Topology(0, 1, 0, 1, "none", device_name=device)
    job = loom.DataParallel(topology=one).setup(model, optimizer, nn.functional.mse_loss)
    loader = job.loader(make_data(), global_batch_size=16, seed=0)
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            losses.append(job.train_step(batch))
            if len(losses) == steps:
                break
    return losses
