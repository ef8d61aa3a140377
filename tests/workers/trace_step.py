"""Which src/loom files one DataParallel ``train_step`` runs on the default CPU path (2 processes, one host:
shared-memory gradients), in the order the step first enters them.

`sys.setprofile` and `threading.setprofile` around one step after 3 warm-up steps (the first steps build what
later steps reuse). Rank 0 prints one JSON line: ``[[file, [functions...]], ...]`` in order of first entry.
Run by tests/test_gradient_path.py; also by hand: ``loom run -n 2 tests/workers/trace_step.py``.
"""

import json
import os
import sys
import threading

import torch
from torch import nn
from torch.utils.data import TensorDataset

import loom

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ds = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
job = loom.DataParallel().setup(model, opt, nn.CrossEntropyLoss())
files: dict[str, set[str]] = {}


def profile(frame, event, arg):
    if event == "call":
        name = frame.f_code.co_filename
        if "/loom/" in name and "loom_bench" not in name:
            files.setdefault(name.split("/loom/", 1)[1], set()).add(frame.f_code.co_name)


it = iter(job.loader(ds, global_batch_size=32))
batches = [next(it) for _ in range(4)]
for batch in batches[:3]:
    job.train_step(batch)
threading.setprofile(profile)
sys.setprofile(profile)
job.train_step(batches[3])
sys.setprofile(None)
threading.setprofile(None)
if int(os.environ.get("RANK", "0")) == 0:
    print(json.dumps([[name, sorted(functions)] for name, functions in files.items()]))
