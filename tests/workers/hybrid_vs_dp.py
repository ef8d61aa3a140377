"""``Hybrid(dp=3)`` and ``DataParallel()`` on 3 processes: the same data axis, so bitwise-equal parameters.

Both train the same MLP (no buffers) with Adam for 4 steps on global batches of 10 (uneven shares 4/3/3, and an
``accumulate``-free DataParallel: one forward per share, as the pipeline of one stage with one micro-batch).
``overlap=False`` makes DataParallel take its shared-memory path whatever the host's cores (Hybrid's data axis has
no backward to overlap). Each rank prints one JSON line: whether every parameter is bitwise equal, the largest
difference, and the paths taken. Run by tests/test_hybrid.py.
"""

import json

import torch
from torch import nn

import loom
from loom.parallel.model.hybrid import Hybrid

STEPS, GLOBAL_BATCH = 4, 10
topo = loom.init()
g = torch.Generator().manual_seed(7)
data = torch.utils.data.TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 3, generator=g))


def train(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    job = strategy.setup(model, optimizer, nn.functional.mse_loss)
    losses = []
    for batch in job.loader(data, GLOBAL_BATCH, seed=3):
        losses.append(job.train_step(batch))
        if len(losses) == STEPS:
            break
    return job, losses


dp_job, dp_losses = train(loom.DataParallel(overlap=False))
hy_job, hy_losses = train(Hybrid(dp=3))
dp_params = dict(dp_job.module.named_parameters())
hy_params = hy_job.module.named_state()
diffs = {k: (hy_params[k] - v).abs().max().item() for k, v in dp_params.items()}
print(
    json.dumps(
        {
            "rank": topo.rank,
            "bitwise": all(torch.equal(hy_params[k], v.detach()) for k, v in dp_params.items()),
            "worst": max(diffs.values()),
            "losses": [dp_losses, hy_losses],
            "dp_path": dp_job.gradient_path.name if dp_job.gradient_path else None,
            "hybrid_shared": hy_job.gradient_averaging.shared is not None,
        }
    ),
    flush=True,
)
