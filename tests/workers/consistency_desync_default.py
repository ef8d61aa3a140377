"""One rank's parameters drift after step 3; fit, left at its default desync check, must stop before saving.

``consistency_desync_default.py DIR``: 12 steps, checkpoint_every=6 and no ``desync_every`` argument. Prints one
JSON line per rank: the step at which ReplicaDesyncError was raised (None if never), its message, the checkpoints
written.

Run by tests/test_consistency.py.
"""

import json
import sys

import torch
from common import make_dataset, make_mlp
from torch import nn

import loom
from loom.checkpoint import list_checkpoints
from loom.fault import ReplicaDesyncError

topo = loom.init()
model = make_mlp()
job = loom.DataParallel().setup(model, torch.optim.Adam(model.parameters(), lr=0.01), nn.functional.mse_loss)
train_step = job.train_step


def perturbing_step(batch):
    loss = train_step(batch)
    if job.step == 3 and topo.rank == 1:
        with torch.no_grad():
            model[0].bias[3] += 1e-6  # one element, one rank: a silent desync
    return loss


job.train_step = perturbing_step
raised_at, message = None, ""
try:
    loom.fit(job, job.loader(make_dataset(), 10, seed=0), steps=12, checkpoint_dir=sys.argv[1],
             checkpoint_every=6, progress=False)  # fmt: skip
except ReplicaDesyncError as err:
    raised_at, message = job.step, str(err)
written = sorted(list_checkpoints(sys.argv[1]))
print(
    json.dumps({"rank": topo.rank, "raised_at": raised_at, "message": message, "written": written}),
    flush=True,
)
