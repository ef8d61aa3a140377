"""What the non-finite guard and the default desync check cost on the demo's model.

``loom run -n 2 -m loom_bench.nonfinite_cost ALLREDUCE STEPS``: 2 processes train `loom.demo.train`'s digits CNN with DataParallel
(global batch 64, SGD with momentum, one thread each) for STEPS timed steps after 10 warm-up steps, then time
50 calls of `check_replicas_agree` (what `loom.fit` runs every ``desync_every`` steps). Prints one JSON line per
rank: median and mean step time, median check time, and the check's cost as a fraction of training time at
fit's default interval. Run it against another checkout's ``src`` (PYTHONPATH) to compare the step time.
"""

import json
import statistics
import sys
import time

import torch
from torch import nn

import loom
from loom.demo.train import digits_cnn, digits_datasets
from loom.fault.desync import check_replicas_agree

allreduce, steps = sys.argv[1], int(sys.argv[2])
topo = loom.init()
train_set = digits_datasets()[0]
model = digits_cnn()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
job = loom.DataParallel(allreduce=allreduce).setup(model, optimizer, nn.functional.cross_entropy)
loader = job.loader(train_set, 64, seed=0)
times: list[float] = []
epoch = 0
while len(times) < steps + 10:
    loader.set_epoch(epoch)
    for batch in loader:
        started = time.perf_counter()
        job.train_step(batch)
        times.append(time.perf_counter() - started)
        if len(times) == steps + 10:
            break
    epoch += 1
times = times[10:]
checks = []
for _ in range(50):
    started = time.perf_counter()
    check_replicas_agree(job.module, job.mesh.group("dp"), step=job.step)
    checks.append(time.perf_counter() - started)
try:
    from loom.train.fit import DESYNC_EVERY as every
except ImportError:
    every = 100
step_s, check_s = statistics.median(times), statistics.median(checks)
print(json.dumps({
    "rank": topo.rank, "allreduce": allreduce, "path": job.gradient_path.name if job.gradient_path else None,
    "step_ms_median": round(step_s * 1e3, 3), "step_ms_mean": round(statistics.mean(times) * 1e3, 3),
    "check_ms_median": round(check_s * 1e3, 3), "desync_every": every,
    "check_fraction_at_default": round(check_s / (every * step_s + check_s), 5),
}), flush=True)  # fmt: skip
