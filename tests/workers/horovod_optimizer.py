"""`hvd.DistributedOptimizer` with ``backward_passes_per_step=2`` on a fixed global batch.

``horovod_optimizer.py OUT.safetensors [fp16]``: every rank takes its contiguous share of each global batch
of 16 samples, splits it into 2 micro-batches, runs backward on each with the loss divided by 2 (Horovod sums
the passes), then steps. That equals one process on the whole global batch (tests/test_horovod.py computes
it). Rank 0 writes the final parameters. Also runs as one process (``python horovod_optimizer.py``).
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import save_file

import loom.horovod as hvd

GLOBAL_BATCH, STEPS, PASSES = 16, 4, 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH * STEPS, 5, generator=g), torch.randn(
        GLOBAL_BATCH * STEPS, 2, generator=g
    )


def main(out: str, fp16: bool) -> None:
    hvd.init()
    model = make_model()
    if hvd.rank() == 1:  # broadcast_parameters must make this irrelevant
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=PASSES, compression=compression)  # fmt: skip
    x, y = data()
    share = GLOBAL_BATCH // hvd.size()
    for step in range(STEPS):
        start = step * GLOBAL_BATCH + hvd.rank() * share
        xs, ys = x[start : start + share], y[start : start + share]
        optimizer.zero_grad()
        for xm, ym in zip(xs.chunk(PASSES), ys.chunk(PASSES), strict=True):
            loss = torch.nn.functional.mse_loss(model(xm), ym) / PASSES
            loss.backward()
        optimizer.step()
    if hvd.rank() == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "fp16")
