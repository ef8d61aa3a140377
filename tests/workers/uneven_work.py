"""Rank 0 works alone between steps (an evaluation), then a true hang: the job must survive the first, stop on the second.

``uneven_work.py TIMEOUT_S SLEEP_S PROGRESS_FILE``: DataParallel steps with ``hang_timeout_s=TIMEOUT_S``. After
step 4 rank 0 sleeps SLEEP_S (well above the timeout) outside any collective while rank 1 goes on into step 5's
collectives and waits there: not a hang. Twelve more steps follow (straggler windows of 4 judge them), then rank 0
writes how many straggler warnings it raised once its watch judged every rank's window through step 17. Then rank 1 skips a metric all-reduce that rank 0 enters, and goes
on into the next step's gradient all-reduce: every rank is inside a collective, and they will never meet, so the
watchdog stops the job. Rank 0 appends each stage to PROGRESS_FILE (its stdout is lost when the job is stopped).

Run by tests/test_uneven_work.py.
"""

import sys
import time

import torch
import torch.distributed as dist
from common import judged_stragglers, make_dataset, make_mlp
from torch import nn

import loom
from loom.fault import watchdog

timeout_s, sleep_s, progress = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
topo = loom.init()


def note(text: str) -> None:
    if topo.is_main:
        with open(progress, "a") as f:
            f.write(f"{text} {time.time()}\n")


model = make_mlp()
job = loom.DataParallel(hang_timeout_s=timeout_s, overlap=False).setup(
    model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss
)
loader = job.loader(make_dataset(), 9, seed=0)
step = 0
while step < 17:
    for batch in loader:
        job.train_step(batch)
        step += 1
        if step == 4 and topo.is_main:
            note("evaluating")
            time.sleep(sleep_s)  # rank-0-only work between steps
            note("evaluated")
        if step == 17:
            break
watch = judged_stragglers(job, topo.is_main)
note(f"straggler warnings {len(watch.warnings)} judged through {watch.judged_steps}")
note("entering the metric all-reduce")
if topo.rank == 1:
    job.train_step(next(iter(loader)))  # skips the metric all-reduce: in the gradient all-reduce instead
else:
    with watchdog.collective("metric all-reduce"):
        dist.all_reduce(torch.ones(1))
note("the hang went unnoticed")
