"""Replicas that differ are refused at setup on every rank (tests/test_consistency.py).

Each case builds, on rank 1 only, something that differs from rank 0, and prints one JSON line per rank and case:
whether setup refused it, and the message. Cases: ``tanh_relu`` (an activation), ``lr`` (0.1 vs 0.01), ``sgd_adam``
(the optimizer's type), ``dropout`` (p), ``same`` (nothing differs: accepted), ``batchnorm`` (a 1-sample share of a
BatchNorm model: refused at the step, naming the fix).
"""

import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import loom
from loom.parallel.consistency import ModelMismatchError

topo = loom.init()
odd = topo.rank == 1


def mlp(activation=nn.Tanh, p: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), activation(), nn.Dropout(p), nn.Linear(16, 4))


def case(name: str):
    """(model, optimizer) of this rank for case ``name``."""
    model = mlp(
        nn.ReLU if odd and name == "tanh_relu" else nn.Tanh, 0.2 if odd and name == "dropout" else 0.1
    )
    if name == "sgd_adam" and odd:
        return model, torch.optim.Adam(model.parameters(), lr=0.1)
    lr = 0.01 if odd and name == "lr" else 0.1
    return model, torch.optim.SGD(model.parameters(), lr=lr)


for name in sys.argv[1:]:
    refused, message = False, ""
    if name == "batchnorm":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        job = loom.DataParallel().setup(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss
        )
        data = TensorDataset(
            torch.randn(7, 8), torch.randn(7, 4)
        )  # batches of 4 then 3: shares 2+2, then 2+1
        try:
            loom.fit(job, job.loader(data, 4, seed=0), steps=2, progress=False)
        except ValueError as err:
            refused, message = True, str(err)
    else:
        model, optimizer = case(name)
        try:
            loom.DataParallel().setup(model, optimizer, nn.functional.mse_loss)
        except ModelMismatchError as err:
            refused, message = True, str(err)
    print(json.dumps({"rank": topo.rank, "case": name, "refused": refused, "message": message}), flush=True)
