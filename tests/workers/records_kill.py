"""A tiny DataParallel job whose step records go where ``loom run --run-dir`` puts them: ``records_kill.py STEPS``.

Run by tests/test_records_kill.py under ``LOOM_FAULTS=kill@RANK:STEP:before`` (the engine SIGKILLs that rank as
it begins that step), to see which records a killed rank left in ``RUN_DIR/metrics``.
"""

import sys

import torch
from common import make_dataset, make_mlp, train_steps
from torch import nn

import loom

steps = int(sys.argv[1])
loom.init()
model = make_mlp()
job = loom.DataParallel().setup(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.functional.mse_loss)
train_steps(job, loom.data.loader(make_dataset(), 8, seed=1), steps)
