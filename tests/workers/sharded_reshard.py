"""Checkpoints written at one world size, resumed at another: the N -> M matrix of tests/test_sharded_matrix.py.

argv[1] = "write" ROOT STEPS: for each stage, `loom.fit` with SGD + momentum to STEPS steps, checkpointing into
ROOT/stage<S>. argv[1] = "resume" STEPS ROOT...: for each ROOT (a copy of what some world size wrote) and each
stage, `loom.fit` to STEPS steps from ROOT/stage<S> (resharded to this world size by `load_resharded`). One JSON
line per fit: the root, the stage, the step and this rank's pieces of the parameters.
"""

import json
import sys

from common import make_dataset, make_mlp, make_optimizer
from torch import nn

import loom

topo = loom.init()
mode = sys.argv[1]
if mode == "write":
    jobs = [(sys.argv[2], int(sys.argv[3]))]
else:
    jobs = [(root, int(sys.argv[2])) for root in sys.argv[3:]]
for root, steps in jobs:
    for stage in (1, 2, 3):
        model = make_mlp()
        job = loom.ShardedDataParallel(stage=stage).setup(
            model, make_optimizer("sgd", model), nn.functional.mse_loss
        )
        result = loom.fit(
            job, job.loader(make_dataset(), 7, seed=1), steps=steps, checkpoint_dir=f"{root}/stage{stage}",
            checkpoint_every=1000, progress=False,
        )  # fmt: skip
        pieces = {
            k: {"lo": v["lo"], "hi": v["hi"], "value": v["value"].tolist()}
            for k, v in job.state_dict()["params"].items()
        }
        record = {"root": root, "stage": stage, "step": job.step, "resumed_from": result.resumed_from}
        print(json.dumps(dict(record, params=pieces)), flush=True)
