"""One rank's parameters are perturbed after step PERTURB_AT; fit's periodic check must stop every rank.

``fault_desync.py CHECK_EVERY PERTURB_AT BAD_RANK``: prints one JSON line per rank with the step the error
was raised at (None if never) and its message.

Run by tests/test_fault.py.
"""

import json
import sys

import torch
from common import make_dataset, make_mlp
from torch import nn

import loom
from loom.fault import ReplicaDesyncError

check_every, perturb_at, bad_rank = (int(a) for a in sys.argv[1:4])
topo = loom.init()
model = make_mlp()
job = loom.DataParallel().setup(model, torch.optim.Adam(model.parameters(), lr=0.01), nn.functional.mse_loss)
train_step = job.train_step


def perturbing_step(batch):
    loss = train_step(batch)
    if job.step == perturb_at and topo.rank == bad_rank:
        with torch.no_grad():
            model[0].bias[3] += 1e-6  # one element, one rank: a silent desync
    return loss


job.train_step = perturbing_step
raised_at, message = None, ""
try:
    loom.fit(
        job, loom.data.loader(make_dataset(), 10, seed=0), steps=12, desync_every=check_every, progress=False
    )
except ReplicaDesyncError as err:
    raised_at, message = job.step, str(err)
print(json.dumps({"rank": topo.rank, "raised_at": raised_at, "message": message}), flush=True)
