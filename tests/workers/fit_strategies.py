"""Every strategy under loom.fit with checkpoints: ``fit_strategies.py NAME=DIR:STEPS ...`` (tests/test_fit_strategies.py), one run per argument.

NAME picks the strategy for this world size (`strategy`); each run builds fresh objects as a restarted script
would and resumes from DIR when it holds a checkpoint. Prints one JSON line per rank and run: the result and a
SHA-256 of this rank's part of the model and optimizer state (bitwise comparison of a resumed run with a straight
one, rank by rank: each rank holds its own shard).
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from common import make_dataset
from pp_common import make_deep_mlp
from torch import nn

import loom
from loom.checkpoint import pack_state

topo = loom.init()


def strategy(name: str):
    """The strategy NAME stands for at this world size (2 or 4 processes)."""
    four = topo.world_size == 4
    return {
        "dp": lambda: loom.DataParallel(),
        "pipeline": lambda: loom.Pipeline(stages=2, microbatches=3),  # dp = world / 2
        "tp": lambda: loom.TensorParallel(size=2),  # dp = world / 2
        "hybrid": lambda: (
            loom.Hybrid(dp=2, pp=2, microbatches=2, allreduce="ring")
            if four
            else loom.Hybrid(pp=2, tp=1, microbatches=2)
        ),
    }[name]()


for run in sys.argv[1:]:
    name, spec = run.split("=", 1)
    checkpoint_dir, steps = spec.rsplit(":", 1)
    model = make_deep_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    job = strategy(name).setup(model, optimizer, nn.functional.mse_loss)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    torch.manual_seed(100 + topo.rank)
    loader = job.loader(make_dataset(), 10, seed=1)
    result = loom.fit(
        job, loader, steps=int(steps), checkpoint_dir=checkpoint_dir, checkpoint_every=3, keep=2,
        lr_scheduler=scheduler, progress=False,
    )  # fmt: skip
    state = job.state_dict()
    digest = hashlib.sha256(
        pack_state({"model": state["model"], "optimizer": state["optimizer"]})
    ).hexdigest()
    record = {
        "rank": topo.rank,
        "run": f"{name}={Path(checkpoint_dir).name}:{steps}",
        "job": type(job).__name__,
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        "loss": result.last_loss,
        "state_sha": digest,
    }
    print(json.dumps(record), flush=True)
