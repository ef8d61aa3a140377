"""Hybrid meshes on 4 processes against one process: 5 steps of the char GPT and of the deep MLP.

Each rank also runs the single-process reference itself (same seed, whole global batches) and prints, per mesh,
the largest loss and parameter differences (parameters from ``full_state_dict`` on rank 0).

Run by tests/test_hybrid.py.
"""

import json

import torch
from pp_common import make_deep_mlp
from torch import nn

import loom
from loom.data import GlobalBatchSampler
from loom.examples.char_gpt import CharGPT, char_dataset, lm_loss
from loom.parallel.model.hybrid import Hybrid

STEPS, GLOBAL_BATCH = 5, 10
topo = loom.init()


def models():
    gpt = (lambda: CharGPT(vocab=32, width=16, n_heads=2, layers=2, context=8), char_dataset(8, 64), lm_loss)
    g = torch.Generator().manual_seed(5)
    mlp_data = torch.utils.data.TensorDataset(
        torch.randn(60, 8, generator=g), torch.randn(60, 4, generator=g)
    )
    return {"gpt": gpt, "mlp": (make_deep_mlp, mlp_data, nn.functional.mse_loss)}


def train(make, data, loss_fn, strategy=None):
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    if strategy is None:  # the single-process reference
        sampler, losses = GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=3), []
        for batch in sampler:
            x, y = data[batch.indices]
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == STEPS:
                return losses, model.state_dict()
    job = strategy.setup(model, optimizer, loss_fn)
    loader = job.loader(data, GLOBAL_BATCH, seed=3)
    losses = []
    for batch in loader:
        losses.append(job.train_step(batch))
        if len(losses) == STEPS:
            return losses, job.full_state_dict()


cases = [
    ("gpt", dict(dp=2, pp=2, microbatches=2, schedule="1f1b")),
    ("gpt", dict(dp=2, tp=2)),
    ("mlp", dict(dp=2, pp=2, microbatches=4, schedule="gpipe")),
    ("gpt", dict(pp=2, tp=2, microbatches=2)),
    # The data axis is DataParallel's: its all-reduce algorithms are exact, its compression is not.
    ("mlp", dict(dp=2, pp=2, microbatches=2, allreduce="ring")),
    ("mlp", dict(dp=2, pp=2, microbatches=2, compression="fp16")),
    ("mlp", dict(dp=2, pp=2, microbatches=2, compression="int8")),
    # plan="auto" splits the Linear-Tanh-Linear pairs of a plain nn.Sequential.
    ("mlp", dict(dp=2, tp=2)),
]
for model_name, mesh in cases:
    make, data, loss_fn = models()[model_name]
    ref_losses, ref_params = train(make, data, loss_fn)
    losses, params = train(make, data, loss_fn, Hybrid(**mesh))
    record = {
        "model": model_name,
        "mesh": mesh,
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
    }
    if params is not None:
        assert params.keys() == ref_params.keys(), sorted(set(params) ^ set(ref_params))
        diffs = {k: (params[k] - v).abs().max().item() for k, v in ref_params.items()}
        record["params"] = max(diffs.values())
        record["worst"] = max(diffs, key=diffs.get)
    print(json.dumps(record), flush=True)
