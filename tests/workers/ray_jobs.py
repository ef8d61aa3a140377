"""Training jobs for the Ray backend: a script (``loom run --backend ray``, `loom.ray.run_script`) and a function
(`loom.ray.run`), both the MLP and data of ``common.py`` under `loom.fit`.

`train` takes a dict: ``strategy`` (``dp``: DataParallel, ``ps``: ParameterServer(mode="sync")), ``steps``,
``global_batch``, ``checkpoint_dir`` (None: no checkpoints), ``every`` (checkpoint_every), ``kill_step`` (on the
first attempt, rank 1 SIGKILLs the process that holds it -- its Ray actor -- right after that step, before any
checkpoint of that step). It returns this rank's final parameters (lists), fit's ``resumed_from`` and steps, the
attempt, the rank and where it was placed (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, LOOM_RUN_DIR). As a script, ``python ray_jobs.py JSON`` takes a list of such dicts, runs them in turn and
writes each result to ``$LOOM_RUN_DIR/result-<strategy>-<rank>.json``.

Run by tests/test_ray.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn


class _KillAfter:
    """An LR "scheduler" that changes nothing: `loom.fit` calls ``step()`` after every optimizer step, before
    that step's checkpoint, which is where the test needs a worker to die."""

    def __init__(self, job, step: int | None, attempt: int) -> None:
        self.job, self.kill_step, self.attempt = job, step, attempt

    def step(self) -> None:
        if self.attempt == 0 and self.job.topology.rank == 1 and self.job.step == self.kill_step:
            os.kill(os.getppid(), signal.SIGKILL)  # the parent is the rank's Ray actor
            signal.pause()  # PDEATHSIG ends this process when the actor is gone

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


def train(cfg: dict) -> dict:
    from common import make_dataset, make_mlp, make_optimizer

    import loom

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    topo = loom.init()
    model = make_mlp()
    optimizer = make_optimizer("sgd", model)
    if cfg["strategy"] == "ps":
        strategy = loom.ParameterServer(mode="sync")
    else:
        strategy = loom.DataParallel(allreduce="native")
    job = strategy.setup(model, optimizer, nn.functional.mse_loss)
    loader = job.loader(make_dataset(), global_batch_size=cfg["global_batch"], seed=1)
    result = loom.fit(
        job,
        loader,
        steps=cfg["steps"],
        checkpoint_dir=cfg.get("checkpoint_dir"),
        checkpoint_every=cfg.get("every", 100),
        keep=100,
        lr_scheduler=_KillAfter(job, cfg.get("kill_step"), attempt),
        progress=False,
    )
    state = job.state_dict()["model"]
    return {
        "rank": topo.rank,
        "attempt": attempt,
        "resumed_from": result.resumed_from,
        "steps": result.steps,
        "params": {k: v.detach().flatten().tolist() for k, v in state.items()},
        "placed": {
            k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "LOOM_RUN_DIR")
        },
    }


def reference_params(cfg: dict) -> dict[str, torch.Tensor]:
    """One process, whole global batches (``common.reference_run``): what every rank's parameters must equal."""
    from common import reference_run

    _, params = reference_run("sgd", cfg["global_batch"], cfg["steps"], seed=1)
    return {k: v.flatten() for k, v in params.items()}


if __name__ == "__main__":
    for run in json.loads(sys.argv[1]):  # several runs in one launch: starting the processes is the slow part
        out = train(run)
        name = f"result-{run['strategy']}-{out['rank']}.json"
        Path(os.environ["LOOM_RUN_DIR"], name).write_text(json.dumps(out))
        print(f"rank {out['rank']} finished {out['steps']} {run['strategy']} steps", flush=True)
