"""A small loom training script for `loom plan` (an MLP chain; --width, --depth, --strategy pipeline names a
strategy the plan must see through). Run by tests/test_plan.py and tests/test_plan_system.py.
"""

import argparse

import torch
from torch import nn

import loom

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--depth", type=int, default=4)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--strategy", default="dp", choices=["dp", "pipeline", "none"])
ns = parser.parse_args()
loom.init()
torch.manual_seed(0)
layers = [nn.Linear(32, ns.width), nn.ReLU()]
for _ in range(ns.depth - 1):
    layers += [nn.Linear(ns.width, ns.width), nn.ReLU()]
layers.append(nn.Linear(ns.width, 10))
model = nn.Sequential(*layers)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(
    torch.randn(1024, 32, generator=generator), torch.randint(0, 10, (1024,), generator=generator)
)
if ns.strategy != "none":
    strategy = loom.Pipeline(stages=4, microbatches=2) if ns.strategy == "pipeline" else loom.DataParallel()
    job = strategy.setup(model, optimizer, nn.functional.cross_entropy)
    loader = job.loader(data, global_batch_size=ns.batch)
    loom.fit(job, loader, epochs=1)
