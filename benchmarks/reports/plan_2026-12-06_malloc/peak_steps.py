"""One DataParallel job of the plan benchmark's large model (tests/workers/plan_tiny.py --width 1536 --depth 6,
Adam, global batch 64) for STEPS steps under `loom run -n 2`: each rank prints one JSON line with its peak RSS
after every step and its milliseconds per step after the first four. COMP names a codec (e.g. fp16) or none.

    COMP=fp16 STEPS=16 [MALLOC_MMAP_THRESHOLD_=131072] loom run -n 2 peak_steps.py
"""

import json
import os
import resource
import sys
import time

import torch
from torch import nn

import loom

comp, steps = os.environ.get("COMP") or None, int(os.environ.get("STEPS", "16"))
loom.init()
torch.manual_seed(0)
layers: list[nn.Module] = [nn.Linear(32, 1536), nn.ReLU()]
for _ in range(5):
    layers += [nn.Linear(1536, 1536), nn.ReLU()]
layers.append(nn.Linear(1536, 10))
model = nn.Sequential(*layers)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(
    torch.randn(1024, 32, generator=generator), torch.randint(0, 10, (1024,), generator=generator)
)
job = loom.DataParallel(**({"compression": comp} if comp else {})).setup(
    model, optimizer, nn.functional.cross_entropy
)
batches = iter(job.loader(data, global_batch_size=64))
peaks, start = [], 0.0
for i in range(steps):
    if i == 4:
        start = time.perf_counter()
    job.train_step(next(batches))
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
ms = (time.perf_counter() - start) / (steps - 4) * 1000
print(
    json.dumps(
        {
            "rank": job.topology.rank,
            "comp": comp or "none",
            "peak_mib": peaks,
            "ms_per_step": round(ms, 1),
            "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "dynamic"),
        }
    ),
    file=sys.stderr,
)
