"""Train the deep MLP with Pipeline(stages=world size) for every schedule × micro-batch count × batch size.

Prints one JSON line per configuration: this rank's losses, its peak activations alive, and (rank 0) the full
parameters after training. One launch covers all configurations; the mesh (and its groups) is built once.

Run by tests/test_pipeline.py.
"""

import json
import sys

from common import make_dataset, make_optimizer
from pp_common import make_deep_mlp
from torch import nn

import loom
from loom.mesh import Mesh
from loom.parallel.pipeline.pipeline import Pipeline

steps = int(sys.argv[1])
topo = loom.init()
p = topo.world_size
mesh = Mesh(pp=p)
data = make_dataset()
named_split = {2: ["4"], 4: ["2", "4", "6"]}[p]
for schedule in ("gpipe", "1f1b"):
    for m in (1, 2, 4, 8):
        for global_batch in (10, 3):
            split = named_split if m == 2 else "balanced"
            model = make_deep_mlp()
            job = Pipeline(stages=p, microbatches=m, schedule=schedule, split=split, mesh=mesh).setup(
                model, make_optimizer("adam", model), nn.functional.mse_loss
            )
            loader = loom.data.loader(data, global_batch, seed=1, topology=job.data_topology)
            losses = []
            while len(losses) < steps:
                for batch in loader:
                    losses.append(job.train_step(batch))
                    if len(losses) == steps:
                        break
            full = job.full_state_dict()
            record = {
                "schedule": schedule,
                "m": m,
                "global_batch": global_batch,
                "losses": losses,
                "peak_live": max(s.peak_live_microbatches for s in job.stage_stats),
                "eval": job.eval_step(data.tensors)["loss"],
                "params": {k: v.flatten().tolist() for k, v in full.items()} if full is not None else None,
            }
            print(json.dumps(record), flush=True)
