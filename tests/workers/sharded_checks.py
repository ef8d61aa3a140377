"""ShardedDataParallel checks that need processes, several per launch (the machine is slow); run by
tests/test_sharded.py.

argv[1] = "guards": for each stage, a NaN step skipped on every rank (parameters unchanged), then the memory of
a larger model with Adam (`job.memory()`); one JSON line per check.
argv[1] = "fit" CKPT_ROOT STEPS: for each stage, `loom.fit` with SGD + momentum to STEPS steps in
CKPT_ROOT/stage<S> (resuming, and resharding, from what is there); the final parameters' pieces as JSON.
"""

import json
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
        print(
            json.dumps({"check": "memory", "stage": stage, "params": n_params, "memory": job.memory()}),
            flush=True,
        )
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
