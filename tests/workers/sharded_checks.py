"""ShardedDataParallel checks that need processes, several per launch (the machine is slow); run by
tests/test_sharded.py.

argv[1] = "guards": for each stage, a NaN step skipped on every rank (parameters unchanged), then the memory of
a larger model with Adam (`job.memory()`, and what the engine sampled into step 2's record); one JSON line per
check.
argv[1] = "fit" CKPT_ROOT STEPS: for each stage, `loom.fit` with SGD + momentum to STEPS steps in
CKPT_ROOT/stage<S> (resuming, and resharding, from what is there); the final parameters' pieces as JSON.
argv[1] = "elastic" CKPT_ROOT STEPS KILL_AT, under ``loom run --max-restarts 2``: stages 1 then 3, checkpoints
every 5 steps; on attempt i (TORCHELASTIC_RESTART_COUNT) the last rank kills itself with SIGKILL just before step
KILL_AT of the i-th stage, so each is restarted once and resumes from its last checkpoint.
"""

import json
import os
import signal
import sys

import torch
from common import make_dataset, make_mlp, make_optimizer
from torch import nn

import loom

topo = loom.init()
mode = sys.argv[1]


def pieces(job) -> dict:
    return {
        k: {"lo": v["lo"], "hi": v["hi"], "value": v["value"].tolist()}
        for k, v in job.state_dict()["params"].items()
    }


if mode == "guards":
    data = make_dataset()
    x, y = data.tensors
    for stage in (1, 2, 3):
        model = make_mlp()
        job = loom.ShardedDataParallel(stage=stage).setup(
            model, make_optimizer("sgd", model), nn.functional.mse_loss
        )
        job.train_step((x[topo.rank * 4 : topo.rank * 4 + 4], y[topo.rank * 4 : topo.rank * 4 + 4]))
        before = pieces(job)
        bad = x[8:12].clone()
        if topo.rank == 1:
            bad[0, 0] = float("nan")
        loss = job.train_step((bad, y[8:12]))
        after = pieces(job)
        job.train_step((x[12:16], y[12:16]))
        print(
            json.dumps(
                {
                    "check": "nan",
                    "stage": stage,
                    "loss": loss,
                    "skipped": job.skipped_steps,
                    "last_skipped": job.last_step_skipped,
                    "unchanged": before == after,
                }
            ),
            flush=True,
        )
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64)
        )
        n_params = sum(p.numel() for p in model.parameters())
        job = loom.ShardedDataParallel(stage=stage).setup(
            model, torch.optim.Adam(model.parameters()), nn.functional.mse_loss
        )
        g = torch.Generator().manual_seed(topo.rank)
        for _ in range(2):
            job.train_step((torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)))
        record = job.metrics.records[-1]  # step 2: sampled by the engine (steps 1, 2, every memory_every-th)
        sampled = {"memory": record.memory, "rss": record.rss_bytes, "peak": record.peak_rss_bytes}
        line = {
            "check": "memory",
            "stage": stage,
            "params": n_params,
            "memory": job.memory(),
            "record": sampled,
        }
        print(json.dumps(line), flush=True)
        del job, model
elif mode == "fit":
    root, steps = sys.argv[2], int(sys.argv[3])
    data = make_dataset()
    for stage in (1, 2, 3):
        model = make_mlp()
        job = loom.ShardedDataParallel(stage=stage).setup(
            model, make_optimizer("sgd", model), nn.functional.mse_loss
        )
        loader = job.loader(data, 7, seed=1)
        loom.fit(
            job,
            loader,
            steps=steps,
            checkpoint_dir=f"{root}/stage{stage}",
            checkpoint_every=1000,
            progress=False,
        )
        print(json.dumps({"stage": stage, "step": job.step, "params": pieces(job)}), flush=True)
elif mode == "elastic":
    root, steps, kill_at = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for index, stage in enumerate((1, 3)):
        model = make_mlp()
        job = loom.ShardedDataParallel(stage=stage).setup(
            model, make_optimizer("sgd", model), nn.functional.mse_loss
        )
        train_step = job.train_step

        def step_or_die(batch, job=job, train_step=train_step, index=index):
            if attempt == index and topo.rank == topo.world_size - 1 and job.step + 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return train_step(batch)

        job.train_step = step_or_die
        result = loom.fit(
            job, job.loader(make_dataset(), 7, seed=1), steps=steps, checkpoint_dir=f"{root}/stage{stage}",
            checkpoint_every=5, progress=False,
        )  # fmt: skip
        record = {"stage": stage, "attempt": attempt, "rank": topo.rank, "step": job.step,
                  "resumed_from": result.resumed_from, "params": pieces(job)}  # fmt: skip
        print(json.dumps(record), flush=True)
