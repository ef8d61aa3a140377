"""Gossip with learning stopped (lr 0) on 4 workers that start from different parameters: the spread shrinks
toward 0 and the replicas converge to the mean of the initial parameters (every exchange conserves the sum),
while every collective of torch.distributed raises inside the training loop and only gossip's point-to-point
bytes are counted.

Arguments: peer choice (ring, exponential, random) and steps. Prints one JSON line per rank with its initial and
final parameters and its `comm_stats()`. Run by tests/test_gossip.py.
"""

import json
import sys

import torch.distributed as dist
from gossip_common import NoCollectives, build, dataset, flat
from torch import nn

import loom
from loom.comm import counters
from loom.parallel.gossip.gossip import Gossip

peers, steps = sys.argv[1], int(sys.argv[2])
topo = loom.init()
data = dataset()
model, opt = build(topo.rank)
initial = flat(model).tolist()
job = Gossip(peers=peers, same_start=False, deadline_s=20.0).setup(model, opt, nn.functional.mse_loss)
counters().reset()
loader = job.loader(data, global_batch_size=8, seed=3)
spreads = []
with NoCollectives():
    while job.step < steps:
        for batch in loader:
            job.train_step(batch)
            spreads.append(job.comm_stats()["spread"])
            if job.step == steps:
                break
dist.barrier()  # every worker is done; service threads answered whatever was still asked
with job.paused():
    final = flat(model).tolist()
stats = job.comm_stats()
job.close()
print(json.dumps({"rank": topo.rank, "initial": initial, "final": final, "stats": stats, "spreads": spreads,
                  "ops": counters().snapshot()["ops"], "counted": counters().totals(),
                  "payload_bytes": job.layout.nbytes}), flush=True)  # fmt: skip
