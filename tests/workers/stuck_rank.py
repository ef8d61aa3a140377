"""A rank stuck in its own code, outside any collective (tests/test_stuck_rank.py).

``stuck_rank.py``: DataParallel steps with ``hang_timeout_s=3``; before step 3 rank 1 calls
`stuck_in_its_own_code`, which sleeps for two minutes, while rank 0 goes on into step 3's collectives and waits.
The watchdog must print rank 1's Python stack (naming that function) once rank 0 has waited past the hang
timeout, then stop the job at the work timeout (``LOOM_WORK_TIMEOUT_S``, set by the test).
"""

import time

import torch
from common import make_dataset, make_mlp
from torch import nn

import loom

topo = loom.init()
model = make_mlp()
job = loom.DataParallel(hang_timeout_s=3).setup(
    model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss
)


def stuck_in_its_own_code() -> None:
    time.sleep(120)


for step, batch in enumerate(job.loader(make_dataset(), 8, seed=0), start=1):
    if step == 3 and topo.rank == 1:
        stuck_in_its_own_code()
    job.train_step(batch)
    if step == 5:
        break
