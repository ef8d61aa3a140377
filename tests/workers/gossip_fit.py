"""Gossip under `loom.fit` with checkpoints and resume: each rank's own state is saved and restored.

Two workers learn (SGD with momentum, an exchange every 4 steps) from the same start on their own shares for 6
steps with a checkpoint every 3; then, in the same processes, a fresh job (another gossip ``namespace``, fresh
model) resumes from that directory: `fit(steps=6)` restores without stepping, and each rank must hold exactly its
own saved parameters, momentum, step and peer choice; `fit(steps=9)` then continues for 3 steps. The argument is
the checkpoint directory. Prints one JSON line per rank. Run by tests/test_gossip.py.
"""

import json
import sys

import torch
from gossip_common import build, dataset, flat
from torch import nn

import loom
from loom.parallel.gossip.gossip import Gossip

directory = sys.argv[1]
topo = loom.init()
data = dataset()


def momentum(job):
    return torch.cat([s["momentum_buffer"].reshape(-1) for s in job.optimizer.state.values()]).tolist()


model, opt = build(0, lr=0.05)
job = Gossip(namespace="first", every=4, deadline_s=20.0).setup(model, opt, nn.functional.mse_loss)
loader = job.loader(data, global_batch_size=8, seed=3)
first = loom.fit(job, loader, steps=6, checkpoint_dir=directory, checkpoint_every=3, progress=False)
with job.paused():
    saved = {"params": flat(model).tolist(), "momentum": momentum(job), "step": job.step,
             "choice": job.choice.count}  # fmt: skip
job.close()

model, opt = build(1, lr=0.05)  # other parameters: only the checkpoint can bring rank 0's and 1's back
job = Gossip(namespace="second", every=4, deadline_s=20.0).setup(model, opt, nn.functional.mse_loss)
loader = job.loader(data, global_batch_size=8, seed=3)
resumed = loom.fit(job, loader, steps=6, checkpoint_dir=directory, progress=False)
restored = {"params": flat(model).tolist(), "momentum": momentum(job), "step": job.step,
            "choice": job.choice.count}  # fmt: skip
more = loom.fit(job, loader, steps=9, checkpoint_dir=directory, checkpoint_every=3, progress=False)
stats = job.comm_stats()
job.close()
print(json.dumps({"rank": topo.rank, "saved": saved, "restored": restored, "stats": stats,
                  "first": [first.steps, first.steps_run, first.resumed_from],
                  "resumed": [resumed.steps, resumed.steps_run, resumed.resumed_from],
                  "more": [more.steps, more.steps_run, more.resumed_from, more.last_loss]}), flush=True)  # fmt: skip
