"""Fit on every rank twice, without and with trackers, counting torch.distributed calls; print one JSON line.

``trackers_fit.py ROOT``: TensorBoard writes to ROOT/tb, MLflow to ROOT/mlruns. Run by tests/test_trackers.py:
only rank 0 may import the trackers' libraries, and the run with trackers must make the same collective calls
as the one without (a tracker logs values the step already reduced).
"""

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from common import make_dataset
from torch import nn

import loom
from loom.comm.counters import counters
from loom.train.fit import fit

os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow >= 3.7's opt-in for its directory store
root = Path(sys.argv[1])
topo = loom.init()
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "barrier", "send", "recv",
               "isend", "irecv", "all_to_all_single", "gather", "scatter")  # fmt: skip
calls: Counter = Counter()
for name in COLLECTIVES:
    if hasattr(dist, name):
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def run(trackers):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    job = loom.DataParallel().setup(model, optimizer, nn.functional.mse_loss)
    loader = loom.data.loader(make_dataset(), 10, seed=1)
    losses = []
    job_step = job.train_step
    job.train_step = lambda batch: losses.append(job_step(batch)) or losses[-1]  # type: ignore[method-assign]
    calls.clear()
    counters().reset()
    fit(job, loader, steps=6, progress=False, trackers=trackers)
    return {"torch.distributed": dict(calls), "loom.comm": counters().snapshot()}, losses


without, _ = run(None)
with_trackers, losses = run([loom.TensorBoardTracker(root / "tb"), loom.MLflowTracker(root / "mlruns")])
imported = ["torch.utils.tensorboard" in sys.modules, "mlflow" in sys.modules]
print(
    json.dumps(
        {"calls_with": with_trackers, "calls_without": without, "losses": losses, "imported": imported}
    )
)
loom.shutdown()
