"""Train until the link between the hosts is cut: DataParallel steps on a tiny model, each step's collectives
counted by loom's watchdog (``LOOM_HANG_TIMEOUT_S`` from the test). Prints ``step N`` after each step.

Run by tests/test_launch_partition.py.
"""

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import loom

topo = loom.init()
torch.manual_seed(0)
model = nn.Linear(8, 2)
job = loom.DataParallel(overlap=False).setup(
    model, torch.optim.SGD(model.parameters(), lr=0.01), nn.functional.mse_loss
)
x = torch.randn(64, 8)
data = TensorDataset(x, x @ torch.randn(8, 2))
deadline = time.monotonic() + 150
step = 0
while time.monotonic() < deadline:
    for batch in job.loader(data, global_batch_size=16, seed=step):
        job.train_step(batch)
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.1)
