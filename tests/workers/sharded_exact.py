"""Train the shared MLP with ShardedDataParallel at every stage; print one JSON line per run (losses, params).

Run by tests/test_sharded.py. argv: global_batch steps [stages, comma-separated].
"""

import json
import sys

from common import make_dataset, make_mlp, make_optimizer
from torch import nn

import loom

global_batch, steps = int(sys.argv[1]), int(sys.argv[2])
stages = (sys.argv[3] if len(sys.argv) > 3 else "1,2,3").split(",")  # "1rs": stage 1 with reduce_scatter
topo = loom.init()
data = make_dataset()
for stage in stages:
    for optimizer, accumulate in (("sgd", 1), ("adam", 1), ("adam", 3)):
        model = make_mlp()
        reduce = "reduce_scatter" if stage.endswith("rs") else "auto"
        strategy = loom.ShardedDataParallel(
            stage=int(stage[0]), accumulate=accumulate, gradient_reduce=reduce
        )
        job = strategy.setup(model, make_optimizer(optimizer, model), nn.functional.mse_loss)
        loader = job.loader(data, global_batch, seed=1)
        losses = []
        while len(losses) < steps:
            for batch in loader:
                losses.append(job.train_step(batch))
                if len(losses) == steps:
                    break
        evaluated = job.eval_step(data.tensors)["loss"]
        parts = job.state_dict()["params"]
        params = {k: {"lo": v["lo"], "hi": v["hi"], "value": v["value"].tolist()} for k, v in parts.items()}
        line = {
            "stage": stage,
            "optimizer": optimizer,
            "accumulate": accumulate,
            "losses": losses,
            "eval": evaluated,
        }
        print(json.dumps(dict(line, params=params)), flush=True)
