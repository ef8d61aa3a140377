"""Processes that build their loaders from different datasets (tests/test_loader.py).

Arguments: the cases to run, in order, all in this one job. Each builds a dataset of 20 samples (8 inputs,
4 targets) and a loader of global batch 8, then prints one JSON line per rank: whether building it raised,
the message, the steps iterated and, for ``augment``, whether the global random generators were left as found.

same          identical seeded data on every rank
seed          synthetic data with a different seed per rank
length        20 samples on rank 0, 21 on rank 1
optout        different seeds, same_data_check=False
augment       identical data, random noise added per sample from the global RNG, seeded differently per rank
job_dp        a DataParallel job's job.loader over different data
job_pipeline  a Pipeline(stages=2) job's job.loader (its data axis has one replica) over different data
"""

import json
import random
import sys
import time

import numpy as np
import torch
from pp_common import make_deep_mlp
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import loom

topo = loom.init()


def synthetic(seed: int, n: int = 20) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))


class Augmented(Dataset):
    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.1 * torch.rand(8) + random.random() + float(np.random.rand()), y


def rng_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def build(case: str):
    if case == "same":
        return loom.data.loader(synthetic(0), 8, seed=1)
    if case == "seed":
        return loom.data.loader(synthetic(topo.rank), 8, seed=1)
    if case == "length":
        return loom.data.loader(synthetic(0, 20 + topo.rank), 8, seed=1)
    if case == "optout":
        return loom.data.loader(synthetic(topo.rank), 8, seed=1, same_data_check=False)
    if case == "augment":
        return loom.data.loader(Augmented(synthetic(0)), 8, seed=1)
    model = make_deep_mlp() if case == "job_pipeline" else nn.Linear(8, 4)
    strategy = loom.Pipeline(stages=2) if case == "job_pipeline" else loom.DataParallel()
    job = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)
    return job.loader(synthetic(topo.rank), 8, seed=1)


for case in sys.argv[1:]:
    torch.manual_seed(100 + topo.rank)
    random.seed(100 + topo.rank)
    np.random.seed(100 + topo.rank)
    before = rng_states()
    started = time.perf_counter()
    raised, steps, after = "", 0, None
    try:
        loader = build(case)
        after = rng_states()  # before iterating: the augmentation itself draws from them
        steps = sum(1 for _ in loader)
    except ValueError as error:
        raised = str(error)
    elapsed = time.perf_counter() - started
    after = after or rng_states()
    untouched = bool(
        torch.equal(before[0], after[0]) and before[1] == after[1] and (before[2] == after[2]).all()
    )
    print(json.dumps({"rank": topo.rank, "case": case, "raised": raised, "steps": steps,
                      "rng_untouched": untouched, "seconds": elapsed}), flush=True)  # fmt: skip
