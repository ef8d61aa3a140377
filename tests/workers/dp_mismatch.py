"""Rank 2 builds a wider hidden layer: every rank must get the same clear error, none may hang.

Run by tests/test_data_parallel.py.
"""

import torch
from torch import nn

import loom
from loom.parallel.consistency import ModelMismatchError

topo = loom.init()
hidden = 17 if topo.rank == 2 else 16
model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4))
try:
    loom.DataParallel().setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)
except ModelMismatchError as error:
    print(f"REFUSED: {error}")
else:
    print("ACCEPTED")
