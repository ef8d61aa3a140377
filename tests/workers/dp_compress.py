"""DataParallel(compression=...) on the shared MLP: one JSON line per codec with losses, params and bytes.

Run by tests/test_data_parallel.py.
"""

import json

from common import make_dataset, make_mlp, make_optimizer
from torch import nn

import loom
from loom import comm

topo = loom.init()
data = make_dataset()
for spec in (None, "fp16", "int8", "powersgd:2", "topk:0.1"):
    model = make_mlp()
    job = loom.DataParallel(compression=spec, bucket_cap_mb=0.001).setup(
        model, make_optimizer("sgd", model), nn.functional.mse_loss
    )
    loader = loom.data.loader(data, 10, seed=1)
    comm.counters().reset()
    batches = [batch for _ in range(3) for batch in loader][:10]  # 10 steps, as the reference run
    losses = [job.train_step(batch) for batch in batches]
    local = job.local_state_dict()["compression"]
    print(json.dumps({
        "spec": spec,
        "losses": losses,
        "params": {k: v.flatten().tolist() for k, v in job.module.state_dict().items()},
        "bytes_sent": comm.counters().snapshot()["bytes_sent"],
        "has_state": local is not None and bool(local.get("buckets")),
    }))  # fmt: skip
