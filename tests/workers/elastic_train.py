"""A loom.fit job that kills one of its own workers with SIGKILL, for ``loom run --max-restarts``.

``elastic_train.py DIR STEPS KILL_AT TIMES_DIR``: on the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank 1
kills itself with SIGKILL just before taking step KILL_AT (KILL_AT 0: never). The times of the events the test
measures are written as files in TIMES_DIR: ``killed`` (with the step), ``survivor_stopped`` (rank 0 of the
first attempt noticed or was stopped), ``resumed`` (the restarted group is about to take its first step).
Prints a JSON line per rank with the result and the final parameters.

Run by tests/test_elastic.py.
"""

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from common import make_dataset, make_mlp
from faults import Fault, Injector
from torch import nn

import loom

checkpoint_dir, steps, kill_at, times = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def note(event: str, text: str = "") -> None:
    """The first process to note ``event`` writes its time (both ranks may try at once: "x" lets one win)."""
    with contextlib.suppress(FileExistsError), open(times / event, "x") as f:
        f.write(f"{time.time()} {text}")


def stopped(signum, frame):
    note("survivor_stopped", "sigterm")
    os._exit(128 + signum)


topo = loom.init()
if attempt == 0 and topo.rank == 0 and kill_at:
    signal.signal(signal.SIGTERM, stopped)
model = make_mlp()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
job = loom.DataParallel().setup(model, optimizer, nn.functional.mse_loss)
train_step = job.train_step


faults = Injector(
    topo.rank,
    [Fault("kill", 1, kill_at, attempt=0)] if kill_at else [],
    attempt,
    lambda _: note("killed", str(job.step)),
)


def instrumented_step(batch):
    if attempt > 0:
        note("resumed", str(job.step))
    faults.before_step(job.step + 1)
    return train_step(batch)


job.train_step = instrumented_step
try:
    result = loom.fit(
        job,
        loom.data.loader(make_dataset(), 10, seed=1),
        steps=steps,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=3,
        keep=5,
        progress=False,
    )
except Exception:
    if attempt == 0 and kill_at:
        note("survivor_stopped", "error")
    raise
params = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
record = {"rank": topo.rank, "attempt": attempt, "steps": result.steps, "resumed_from": result.resumed_from}
print(json.dumps(dict(record, params=params)), flush=True)
