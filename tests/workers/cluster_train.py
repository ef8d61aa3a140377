"""A training script for `loom run --cluster` tests: the MLP of common.py, SGD with momentum, global batch 8.

Arguments: ``dp`` or ``ps`` (``DataParallel()`` or ``ParameterServer(mode="sync")``), the number of steps, and
an output folder; rank 0 writes ``result.json`` there with the losses and the final parameters, which the test
compares with ``common.reference_run("sgd", 8, steps)``. Each worker also prints the interface gloo used.

Run by tests/test_cluster_spec.py.
"""

import json
import os
import sys
from pathlib import Path

from common import make_dataset, make_mlp, make_optimizer
from torch import nn

import loom

kind, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
topo = loom.init()
model = make_mlp()
opt = make_optimizer("sgd", model)
strategy = loom.DataParallel() if kind == "dp" else loom.ParameterServer(mode="sync")
job = strategy.setup(model, opt, nn.functional.mse_loss)
loader = job.loader(make_dataset(), global_batch_size=8, seed=1)
losses: list[float] = []
while len(losses) < steps:
    for batch in loader:
        losses.append(job.train_step(batch))
        if len(losses) == steps:
            break
print(f"rank {topo.rank} of {topo.world_size} via {os.environ.get('GLOO_SOCKET_IFNAME')}", flush=True)
if topo.is_main:
    params = {k: v.flatten().tolist() for k, v in job.state_dict()["model"].items()}
    (out / "result.json").write_text(json.dumps({"losses": losses, "params": params}))
