"""SharedGradients against the plain average of every rank's gradients; DataParallel's choice of path.

Prints one JSON line: the largest difference to the gathered average over a few steps (one parameter unused in
the forward, so its gradient is None on every rank) and to the sum of the float64 values carried along, the
refusal of a bad one, whether each .grad is a view of this process's slot, the shm bytes counted per step, and
which path DataParallel took for a model with a BatchNorm buffer and when no segment can be created.

Run by tests/test_shared_gradients.py.
"""

import json
import warnings

import torch
import torch.distributed as dist
from torch import nn

import loom
import loom.comm.shm as shm
from loom.comm import counters
from loom.comm.shared_gradients import SharedGradients


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.body(x)


topo = loom.init()
torch.manual_seed(0)
model = WithUnused()
shared = SharedGradients(model, extra_values=3)
worst = 0.0
for step in range(3):
    for p in model.parameters():
        p.grad = None
    g = torch.Generator().manual_seed(100 * step + topo.rank)
    model(torch.randn(4 + topo.rank, 5, generator=g)).pow(2).mean().backward()
    local = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    before = counters().shm_bytes_sent
    extra = torch.tensor([topo.rank + 0.25, step * 10.0**topo.rank], dtype=torch.float64)
    shared.average(extra)
    sent = counters().shm_bytes_sent - before - extra.nbytes
    worst_extra = max(
        abs(extra[0].item() - sum(r + 0.25 for r in range(topo.world_size))),
        abs(extra[1].item() - sum(step * 10.0**r for r in range(topo.world_size))),
    )
    for p, mine in zip(model.parameters(), local, strict=True):
        every = [torch.empty_like(mine) for _ in range(topo.world_size)]
        dist.all_gather(every, mine)
        mean = torch.stack(every).sum(0) / topo.world_size
        worst = max(worst, (p.grad - mean).abs().max().item())
slot = shared.slots[shared.context.local_rank]
views = all(
    p.grad.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr() for p in model.parameters()
)
try:
    shared.average(torch.zeros(2))  # float32: refused before any process waits for the others
    refused = ""
except ValueError as error:
    refused = str(error)
lo, hi = shared.chunk
normed = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
with_buffers = loom.DataParallel(allreduce="shm", overlap=False).setup(
    normed, torch.optim.SGD(normed.parameters(), lr=0.1), nn.functional.mse_loss
)
with_buffers.train_step((torch.randn(4, 4), torch.randn(4, 4)))


def no_room(*args, **kwargs):
    raise OSError("cannot reserve shared memory (simulated: /dev/shm full)")


# /dev/shm too small for the gradients (the host's first process cannot create the segment): every process
# falls back to DDP with a warning naming the cause, and trains
shm.Segment.create = no_room  # type: ignore[method-assign]
small = nn.Linear(4, 2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fallback = loom.DataParallel(allreduce="shm", overlap=False).setup(
        small, torch.optim.SGD(small.parameters(), lr=0.1), nn.functional.mse_loss
    )
fallback_loss = fallback.train_step((torch.ones(4, 4), torch.zeros(4, 2)))
print(json.dumps({"worst": worst, "views": views, "sent_per_step": sent, "chunk_bytes": (hi - lo) * 4,
                  "buffers_shared": with_buffers.shared_gradients is not None, "worst_extra": worst_extra,
                  "refused": refused, "fallback_shared": fallback.shared_gradients is not None,
                  "fallback_warnings": [str(w.message) for w in caught], "fallback_loss": fallback_loss}))  # fmt: skip
