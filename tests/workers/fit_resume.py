"""Train with loom.fit to a total step count, checkpointing into a directory; print the result and parameters.

``fit_resume.py [--compression=SPEC] DIR:STEPS[:forget-local] ...``: one run per argument, each from freshly
built objects as a restarted script would, resuming from DIR when it holds a checkpoint (several runs share a
launch because starting processes is the slow part). Each rank seeds its RNG differently after setup, so dropout
masks differ per rank and resuming must restore every rank's own RNG state, not just rank 0's.
``--compression`` trains with ``DataParallel(compression=SPEC)``; ``forget-local`` makes that run ignore the
per-rank state it resumes from (the error feedback), as loom.fit did before it saved it: a negative control.

Run by tests/test_fit.py.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from common import make_dataset
from torch import nn

import loom
from loom.checkpoint import pack_state
from loom.train.fit import fit

topo = loom.init()
args = sys.argv[1:]
compression = args.pop(0).split("=", 1)[1] if args and args[0].startswith("--compression=") else None
for run in args:
    checkpoint_dir, steps, *options = run.split(":")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    job = loom.DataParallel(compression=compression).setup(model, optimizer, nn.functional.mse_loss)
    if "forget-local" in options:
        job.load_local_state_dict = lambda state: None  # type: ignore[method-assign]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    torch.manual_seed(100 + topo.rank)
    loader = loom.data.loader(make_dataset(), 10, seed=1)
    result = fit(
        job,
        loader,
        steps=int(steps),
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=2,
        keep=2,
        lr_scheduler=scheduler,
        progress=False,
    )
    params = {k: v.flatten().tolist() for k, v in job.module.state_dict().items()}
    print(
        json.dumps(
            {
                "rank": topo.rank,
                "dir": checkpoint_dir,
                "run": ":".join([Path(checkpoint_dir).name, steps, *options]),
                "steps": result.steps,
                "resumed_from": result.resumed_from,
                "steps_run": result.steps_run,
                "loss": result.last_loss,
                "params": params,
                # this rank's error feedback as it stands (bitwise, as a hash): what a resume must restore
                "local_sha": hashlib.sha256(pack_state(job.local_state_dict())).hexdigest(),
            }
        )
    )
