"""One strategy for a few steps on the job's device (the GPU lane, tests/test_gpu.py): ``gpu_train.py NAME STEPS``.

The model and data are float64 (`gpu_common`), so losses on a GPU match the CPU reference to ~1e-12 whatever the
summation order. Prints one JSON line per rank: its device, the device its parameters ended on, the losses, and
rank 0's parameters for the strategies whose ``job.module`` holds the whole model.
"""

import json
import sys

import torch
from gpu_common import STRATEGIES, make_data, make_model, reference_losses

import loom

name, steps = sys.argv[1], int(sys.argv[2])
topo = loom.init()
model, optimizer = make_model()
job = STRATEGIES[name]().setup(model, optimizer, torch.nn.functional.mse_loss)
loader = job.loader(make_data(), global_batch_size=16, seed=0)
losses: list[float] = []
while len(losses) < steps:
    for batch in loader:
        losses.append(job.train_step(batch))
        if len(losses) == steps:
            break
params = {p.device.type for p in job.module.parameters()}
whole = name in ("dp", "localsgd") and topo.rank == 0
print(json.dumps({
    "rank": topo.rank, "device": str(topo.device), "param_devices": sorted(params), "losses": losses,
    "params": [p.detach().cpu().flatten().tolist() for p in job.module.parameters()] if whole else None,
    "reference": reference_losses(steps) if topo.rank == 0 else None,
}), flush=True)  # fmt: skip
