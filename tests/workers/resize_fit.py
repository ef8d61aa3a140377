"""Train with loom.fit to a total step count, checkpointing; resumable at another world size.

``resize_fit.py DIR:STEPS[:scale] ...``: one run per argument, from freshly built objects as a restarted script
builds them; ``scale`` resumes with ``scale_lr_with_world_size=True``. No dropout, so the result does not depend
on per-rank RNG streams (which cannot carry over to another world size). Prints a JSON line per run.

Run by tests/test_resize.py.
"""

import json
import sys

import torch
from common import make_dataset, make_mlp
from torch import nn

import loom

topo = loom.init()
for run in sys.argv[1:]:
    checkpoint_dir, steps, *flags = run.split(":")
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    job = loom.DataParallel().setup(model, optimizer, nn.functional.mse_loss)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    result = loom.fit(
        job,
        loom.data.loader(make_dataset(), 10, seed=1),
        steps=int(steps),
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=3,
        lr_scheduler=scheduler,
        scale_lr_with_world_size="scale" in flags,
        progress=False,
    )
    record = {
        "rank": topo.rank,
        "world": topo.world_size,
        "dir": checkpoint_dir,
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        "loss": result.last_loss,
        "lr": optimizer.param_groups[0]["lr"],
        "params": {k: v.flatten().tolist() for k, v in model.state_dict().items()},
    }
    print(json.dumps(record), flush=True)
