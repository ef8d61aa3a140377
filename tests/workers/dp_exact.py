"""Train the shared MLP with DataParallel; print one JSON line per (optimizer, accumulate) with losses+params.

Run by tests/test_data_parallel.py.
"""

import json
import sys

from common import make_dataset, make_mlp, make_optimizer
from torch import nn

import loom

global_batch, steps = int(sys.argv[1]), int(sys.argv[2])
allreduce = sys.argv[3] if len(sys.argv) > 3 else "native"
topo = loom.init()
data = make_dataset()
for optimizer in ("sgd", "adam"):
    for accumulate in (1, 3):
        model = make_mlp()
        # overlap=False: shared-memory gradients on any host (the default overlaps where a core is spare)
        overlap = False if allreduce in ("shm", "auto", "hierarchical") else None
        job = loom.DataParallel(accumulate=accumulate, allreduce=allreduce, overlap=overlap).setup(
            model, make_optimizer(optimizer, model), nn.functional.mse_loss
        )
        loader = loom.data.loader(data, global_batch, seed=1)
        losses = []
        while len(losses) < steps:
            for batch in loader:
                losses.append(job.train_step(batch))
                if len(losses) == steps:
                    break
        params = {k: v.flatten().tolist() for k, v in job.module.state_dict().items()}
        print(
            json.dumps(
                {
                    "optimizer": optimizer,
                    "accumulate": accumulate,
                    "losses": losses,
                    "params": params,
                    "shared_gradients": job.shared_gradients is not None,
                }
            )  # fmt: skip
        )
