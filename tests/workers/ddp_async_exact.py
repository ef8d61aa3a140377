"""Backward of an MLP under DDP (several small buckets), without a hook and with `overlapped_allreduce_hook`.

Prints one JSON line: per configuration, the gradients of two consecutive iterations (DDP rebuilds its buckets
after the first), the ops counted, and, last, what backward raised when the all-reduce was made to fail.

Run by tests/test_ddp_async.py.
"""

import copy
import json

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import loom
from loom import comm
from loom.comm import ddp_async

topo = loom.init()
torch.manual_seed(0)
base = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def run(hook, iterations: int = 2) -> list[list[float]]:
    model = copy.deepcopy(base)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # ~10 KB buckets: several per backward
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    out = []
    for it in range(iterations):
        g = torch.Generator().manual_seed(100 * topo.rank + it)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]).tolist())
    return out


result = {"runs": {}}
for name in ("none", "shm", "auto", "ring"):
    comm.counters().reset()
    hook = None if name == "none" else ddp_async.overlapped_allreduce_hook(name)
    result["runs"][name] = {"grads": run(hook), "ops": comm.counters().snapshot()["ops"]}


def broken(*args, **kwargs):
    raise RuntimeError("injected failure")


ddp_async.all_reduce = broken
try:
    run(ddp_async.overlapped_allreduce_hook("shm"), iterations=1)
    result["error"] = None
except RuntimeError as error:
    result["error"] = str(error)
print(json.dumps(result))
