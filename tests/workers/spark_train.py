"""A loom training function (and script) for `loom.spark.run` and `TorchDistributor` tests.

`train(kind, steps)` trains the MLP of common.py with SGD and momentum, global batch 8, under ``DataParallel()``
(``kind="dp"``), and returns rank 0's losses and final parameters with what each rank saw of the job secret: its
hash gathered from every rank (zeros: none), and whether it appears in the worker's command line or initial environment
(``/proc/self/cmdline``, ``/proc/self/environ``). ``kind="fail"`` makes rank 1 raise at once. As a script
(``python spark_train.py KIND STEPS OUT``) rank 0 writes the same to ``OUT/result.json``.

Run by tests/test_spark.py.
"""

import hashlib
import json
import os
import sys
from pathlib import Path


def train(kind: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from common import make_dataset, make_mlp, make_optimizer
    from torch import nn

    import loom

    topo = loom.init()
    if kind == "fail" and topo.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    model = make_mlp()
    job = loom.DataParallel().setup(model, make_optimizer("sgd", model), nn.functional.mse_loss)
    loader = job.loader(make_dataset(), global_batch_size=8, seed=1)
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            losses.append(job.train_step(batch))
            if len(losses) == steps:
                break
    secret = os.environ.get("LOOM_JOB_SECRET", "")
    raw = [Path("/proc/self/cmdline").read_bytes(), Path("/proc/self/environ").read_bytes()]
    digest = hashlib.sha256(secret.encode()).digest() if secret else bytes(32)
    in_proc = bool(secret) and any(secret.encode() in r for r in raw)
    mine = torch.tensor(list(digest) + [int(in_proc)], dtype=torch.uint8)
    everyone = [torch.zeros_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(everyone, mine)  # tensors, not all_gather_object: no pickle on the wire
    seen = [{"hash": bytes(t[:32].tolist()).hex(), "in_proc": bool(t[32])} for t in everyone]
    params = {k: v.flatten().tolist() for k, v in job.state_dict()["model"].items()}
    return {
        "losses": losses,
        "params": params,
        "secrets": seen,
        "world_size": topo.world_size,
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    kind, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    result = train(kind, steps)
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "result.json").write_text(json.dumps(result))
