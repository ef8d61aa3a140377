"""ParameterServer (Adam, StepLR) under loom.fit; one JSON line per run and rank.

The argument is JSON ``{"runs": [run, ...]}``, the runs taken in order in one launch (starting processes is the
slow part). A run has: ``ns`` (the model's namespace on the servers), ``dir`` (fit's checkpoint_dir, or null),
``steps`` (fit's total), ``every`` (checkpoint_every, default 5), ``mode`` (default sync), ``desync`` (fit's
desync_every, default 0), ``dropout`` (a Dropout layer, so each rank's RNG
state matters: every rank seeds differently after setup), ``strategy`` ("ps", or "dp" for a DataParallel
reference), ``kill_at`` (on the first attempt under ``--max-restarts``, rank 1 SIGKILLs itself just before that
step), ``diverge_at`` (on that attempt, from that step on, the learning rate is 10x: the steps the restart loses
differ from those it takes again) and ``attempt`` (run it only on that attempt).

Each line: the run, the rank, the attempt, fit's result, this rank's clock and final parameters (the servers'
values), and on rank 0 the servers' state as it stands (version, clocks) with a SHA-256 of all of it (parameters,
optimizer state, hyperparameters, clocks): what an exact resume must reproduce bitwise.

Run by tests/test_ps_fit.py.
"""

import hashlib
import json
import os
import sys

import torch
from common import make_dataset
from faults import Fault, Injector
from torch import nn

import loom

config = json.loads(sys.argv[1])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
topo = loom.init()


def servers_digest(servers: list[dict]) -> str:
    digest = hashlib.sha256()
    for server in servers:
        meta = {k: server["meta"][k] for k in ("version", "param_groups", "optimizer_scalars")}
        # The clocks, not the workers' status: a worker done with the run may have said goodbye already.
        meta["clocks"] = server["meta"]["clocks"]["clocks"]
        digest.update(json.dumps(meta, sort_keys=True).encode())
        for key in sorted(server["tensors"]):
            digest.update(key.encode() + server["tensors"][key].numpy().tobytes())
    return digest.hexdigest()


for run in config["runs"]:
    if run.get("attempt", attempt) != attempt:
        continue
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    if run.get("dropout"):
        layers.insert(1, nn.Dropout(0.25))
    model = nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if run.get("strategy", "ps") == "dp":
        job = loom.DataParallel().setup(model, optimizer, nn.functional.mse_loss)
    else:
        strategy = loom.ParameterServer(mode=run.get("mode", "sync"), namespace=run["ns"])
        job = strategy.setup(model, optimizer, nn.functional.mse_loss)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    if run.get("kill_at") and attempt == 0:
        train_step = job.train_step
        faults = Injector(topo.rank, [Fault("kill", 1, run["kill_at"], attempt=0)], attempt)

        def first_attempt(batch, run=run, job=job, train_step=train_step, faults=faults):
            faults.before_step(job.step + 1)
            if job.step + 1 == run.get(
                "diverge_at"
            ):  # the steps to be lost go elsewhere than the redone ones
                for group in job.optimizer.param_groups:
                    group["lr"] *= 10
            return train_step(batch)

        job.train_step = first_attempt
    torch.manual_seed(100 + topo.rank)
    result = loom.fit(
        job,
        job.loader(make_dataset(), 10, seed=1),
        steps=run["steps"],
        checkpoint_dir=run.get("dir"),
        checkpoint_every=run.get("every", 5),
        keep=2,
        lr_scheduler=scheduler,
        desync_every=run.get("desync", 0),
        progress=False,
    )
    record = {
        "ns": run["ns"],
        "rank": topo.rank,
        "attempt": attempt,
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        "steps_run": result.steps_run,
        "loss": result.last_loss,
        "clock": job.step,
    }
    if isinstance(job, loom.parallel.ParameterServerJob):
        state = job.state_dict()  # every rank: the servers' current parameters; rank 0: the servers' state
        if state["servers"] is not None:
            record["version"] = [s["meta"]["version"] for s in state["servers"]]
            record["clocks"] = [s["meta"]["clocks"]["clocks"] for s in state["servers"]]
            record["servers_sha"] = servers_digest(state["servers"])
        job.close()
    record["params"] = {k: v.flatten().tolist() for k, v in job.module.state_dict().items()}
    print(json.dumps(record), flush=True)
