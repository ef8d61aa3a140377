"""A sharded data axis (``zero=1``) on 4 processes: ``hybrid_sharded.py exact`` or ``hybrid_sharded.py fit RUN...``.

``exact``: Hybrid(dp=2, tp=2, zero=1) (Adam, SGD with momentum) and Pipeline(stages=2, zero=1) (dp=2) against one
process: 5 steps with uneven shares (a global batch of 7 over dp=2: 4 and 3 samples). Each rank also runs the
one-process reference itself (same seed, whole global batches) and prints one JSON line per case: the largest
loss difference and, on rank 0, the largest parameter difference (``full_state_dict``). Then the memory: the
same Hybrid(dp=2, tp=2) job with zero=0 and zero=1, this rank's optimizer-state bytes after the steps
(`ModelParallelJob.memory`, every live tensor walked) and the sum of the optimizer's state tensors.

``fit``: each RUN is ``NAME=DIR:STEPS``, run in order with fresh objects as a restarted script would, through
loom.fit with checkpoints every 3 steps in DIR (Hybrid(dp=2, tp=2, zero=1), Adam and a StepLR). NAME ``zero0``
builds the job with zero=0 instead and must be refused on resume (the record carries the error). Prints one
JSON line per rank and run: the result and a SHA-256 of this rank's model and optimizer state.

Run by tests/test_hybrid_sharded.py.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from common import make_dataset
from pp_common import make_deep_mlp
from torch import nn

import loom
from loom.checkpoint import pack_state
from loom.data import GlobalBatchSampler
from loom.examples.char_gpt import CharGPT, char_dataset, lm_loss

STEPS, GLOBAL_BATCH = 5, 7
topo = loom.init()


def gpt():
    return CharGPT(vocab=32, width=16, n_heads=2, layers=2, context=8)


def mlp_data():
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(60, 8, generator=g), torch.randn(60, 4, generator=g))


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}


def train(make, data, loss_fn, optimizer_name, strategy=None):
    torch.manual_seed(0)
    model = make()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
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
                return losses, model.state_dict(), None
    job = strategy.setup(model, optimizer, loss_fn)
    loader = job.loader(data, GLOBAL_BATCH, seed=3)
    losses = []
    for batch in loader:
        assert job.topology.world_size == 4
        losses.append(job.train_step(batch))
        if len(losses) == STEPS:
            return losses, job.full_state_dict(), job


def optimizer_state_bytes(optimizer):
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def exact():
    cases = [
        ("gpt", "adam", lambda: loom.Hybrid(dp=2, tp=2, zero=1)),
        ("gpt", "sgd", lambda: loom.Hybrid(dp=2, tp=2, zero=1)),
        ("mlp", "adam", lambda: loom.Pipeline(stages=2, microbatches=2, zero=1)),
        ("mlp", "sgd", lambda: loom.Pipeline(stages=2, microbatches=2, schedule="gpipe", zero=1)),
    ]
    models = {
        "gpt": (gpt, char_dataset(8, 64), lm_loss),
        "mlp": (make_deep_mlp, mlp_data(), nn.functional.mse_loss),
    }
    for model_name, optimizer_name, strategy in cases:
        make, data, loss_fn = models[model_name]
        ref_losses, ref_params, _ = train(make, data, loss_fn, optimizer_name)
        losses, params, job = train(make, data, loss_fn, optimizer_name, strategy())
        record = {
            "case": f"{model_name} {optimizer_name} {type(strategy()).__name__}",
            "dp": job.mesh.size("dp"),
            "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        }
        if params is not None:
            assert params.keys() == ref_params.keys(), sorted(set(params) ^ set(ref_params))
            record["params"] = max((params[k] - v).abs().max().item() for k, v in ref_params.items())
        print(json.dumps(record), flush=True)
    make, data, loss_fn = models["gpt"]
    memory = {}
    for zero in (0, 1):
        _, _, job = train(make, data, loss_fn, "adam", loom.Hybrid(dp=2, tp=2, zero=zero))
        memory[zero] = dict(job.memory(), summed=optimizer_state_bytes(job.optimizer))
    print(json.dumps({"memory": memory}), flush=True)


def fit(runs):
    for run in runs:
        name, spec = run.split("=", 1)
        checkpoint_dir, steps = spec.rsplit(":", 1)
        model = make_deep_mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        zero = 0 if name == "zero0" else 1
        job = loom.Hybrid(dp=2, tp=2, zero=zero).setup(model, optimizer, nn.functional.mse_loss)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        loader = job.loader(make_dataset(), GLOBAL_BATCH, seed=1)
        record = {"rank": topo.rank, "run": name, "steps_asked": int(steps)}
        try:
            result = loom.fit(
                job, loader, steps=int(steps), checkpoint_dir=checkpoint_dir, checkpoint_every=3, keep=2,
                lr_scheduler=scheduler, progress=False,
            )  # fmt: skip
        except ValueError as error:
            record["error"] = str(error)
            print(json.dumps(record), flush=True)
            continue
        state = job.state_dict()
        digest = hashlib.sha256(
            pack_state({"model": state["model"], "optimizer": state["optimizer"]})
        ).hexdigest()
        record.update(
            steps=result.steps,
            resumed_from=result.resumed_from,
            loss=result.last_loss,
            state_sha=digest,
            optimizer_keys=len(state["optimizer"]["state"]),
            dir=Path(checkpoint_dir).name,
        )
        print(json.dumps(record), flush=True)


if sys.argv[1] == "exact":
    exact()
else:
    fit(sys.argv[2:])
