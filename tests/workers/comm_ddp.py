"""One backward of a tiny MLP under DDP, with no hook and with each loom.comm hook; print one JSON line.

Each rank also computes the single-process reference: the mean of every rank's local gradient (each rank's
data is seeded by its rank, so any process can rebuild all of it).

Run by tests/test_comm.py.
"""

import copy
import json

import torch
from common import make_mlp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import loom
from loom import comm

topo = loom.init()


def shard(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(r)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def grads(model: nn.Module) -> list[float]:
    return torch.cat([p.grad.flatten() for p in model.parameters()]).tolist()


base = make_mlp()
reference = []
for r in range(topo.world_size):
    model = copy.deepcopy(base)
    x, y = shard(r)
    nn.functional.mse_loss(model(x), y).backward()
    reference.append(torch.tensor(grads(model)))
result = {"reference": (sum(reference) / topo.world_size).tolist(), "runs": {}}

for algorithm in ("none", *comm.ALGORITHMS):
    model = copy.deepcopy(base)
    ddp = DistributedDataParallel(model)
    if algorithm != "none":
        ddp.register_comm_hook(None, comm.allreduce_hook(algorithm))
    comm.counters().reset()
    x, y = shard(topo.rank)
    nn.functional.mse_loss(ddp(x), y).backward()
    result["runs"][algorithm] = {"grads": grads(model), "counters": comm.counters().snapshot()}
result["param_bytes"] = sum(p.nbytes for p in base.parameters())
print(json.dumps(result))
