"""One small job per strategy with a fault on one rank (tests/test_guard.py): the step guard must hold for all.

``guard_job.py STRATEGIES FAULT OUT_DIR``: STRATEGIES is a comma-separated list of names of `STRATEGIES`, set up
and trained one after the other in the same processes; FAULT is ``nan`` (one sample's input set to NaN on the
rank that reads inputs, at step `FAULT_AT`) or ``freeze`` (that rank stops itself with SIGSTOP before step
`FAULT_AT`, after writing the time to OUT_DIR/frozen-at). Trains `STEPS` steps of `make_deep_mlp` with
``hang_timeout_s=5`` and writes OUT_DIR/result-NAME-RANK.json: whether its parameters are finite, the steps the
job skipped and its step records marked skipped, and the losses it returned.
"""

import json
import math
import os
import sys
import time

import torch
from common import make_dataset
from faults import Fault, Injector
from pp_common import make_deep_mlp
from torch import nn

import loom

STEPS, FAULT_AT, HANG_S = 8, 3, 5
STRATEGIES = {  # name: (strategy, the rank whose input is poisoned or that freezes)
    "dp": (lambda: loom.DataParallel(hang_timeout_s=HANG_S), 1),
    "pipeline": (lambda: loom.Pipeline(stages=2, microbatches=2, hang_timeout_s=HANG_S), 0),  # stage 0 reads
    "tp": (lambda: loom.TensorParallel(size=2, hang_timeout_s=HANG_S), 1),
    "hybrid": (lambda: loom.Hybrid(dp=2, hang_timeout_s=HANG_S), 1),
    "local_sgd": (lambda: loom.LocalSGD(sync_every=2, hang_timeout_s=HANG_S), 1),
    "diloco": (lambda: loom.DiLoCo(sync_every=2, hang_timeout_s=HANG_S), 1),
    "gossip": (lambda: loom.Gossip(hang_timeout_s=HANG_S, deadline_s=2.0), 1),
    "ps": (lambda: loom.ParameterServer(mode="sync", hang_timeout_s=HANG_S, namespace="sync"), 1),
    "ps_async": (lambda: loom.ParameterServer(mode="async", hang_timeout_s=HANG_S, namespace="async"), 1),
}

names, fault, out_dir = sys.argv[1:4]
topo = loom.init()


def frozen(fault: Fault) -> None:
    if fault.kind == "freeze":
        with open(os.path.join(out_dir, "frozen-at"), "w") as f:
            f.write(str(time.time()))


def train(name: str) -> dict:
    make_strategy, bad_rank = STRATEGIES[name]
    faults = Injector(topo.rank, [Fault(fault, bad_rank, FAULT_AT)], on_fire=frozen)
    model = make_deep_mlp()
    job = make_strategy().setup(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.functional.mse_loss)
    losses = []
    for step, batch in enumerate(job.loader(make_dataset(), 8, seed=0), start=1):
        if step > STEPS:
            break
        faults.before_step(
            step, batch
        )  # the NaN in place: the batch keeps its layout (global size, fingerprint)
        losses.append(job.train_step(batch))
    module = job.fetch_parameters() if hasattr(job, "fetch_parameters") else job.module
    return {
        "rank": topo.rank,
        "params_finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()),
        "skipped_steps": job.skipped_steps,
        "skipped_in_records": [r.step for r in job.metrics.records if r.skipped],
        "losses": [loss if math.isfinite(loss) else str(loss) for loss in losses],
        "loss_scope": job.loss_scope,
    }


for name in names.split(","):
    result = train(name)
    with open(os.path.join(out_dir, f"result-{name}-{topo.rank}.json"), "w") as f:
        json.dump(result, f)
