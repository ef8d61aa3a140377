"""LocalSGD and DiLoCo against DataParallel and one process; DiLoCo's fragments and compressed bytes, counted.

``local_sgd_exact.py N_SAMPLES GLOBAL_BATCH STEPS``: run by tests/test_local_sgd.py and tests/test_diloco.py.
Every rank prints JSON lines ``{"case": ..., ...}``: the losses and final parameters of each run (plain SGD, no
momentum, so that ``sync_every=1`` is exactly synchronous SGD), rank 0 also a single-process reference on the same
global batches; then DiLoCo's synchronization log with fragments, and the bytes of its outer exchanges with each
compression.
"""

import json
import sys

import torch
from common import make_dataset, make_mlp
from torch import nn

import loom
from loom.comm import counters
from loom.data import GlobalBatchSampler

n_samples, global_batch, steps = (int(a) for a in sys.argv[1:4])
topo = loom.init()
data = make_dataset(n_samples)
LR = 0.1


def params_of(model: nn.Module) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def train(strategy, steps_: int = steps, make_model=make_mlp):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    job = strategy.setup(model, optimizer, nn.functional.mse_loss)
    loader = job.loader(data, global_batch, seed=1)
    losses = []
    while len(losses) < steps_:
        for batch in loader:
            losses.append(job.train_step(batch))
            if len(losses) == steps_:
                break
    return job, losses


def emit(case: str, **fields) -> None:
    print(json.dumps({"case": case, "rank": topo.rank, **fields}), flush=True)


if topo.rank == 0:  # one process, whole global batches
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = GlobalBatchSampler(len(data), global_batch, seed=1)
    losses = []
    while len(losses) < steps:
        for batch in sampler:
            x, y = data[batch.indices]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    emit("reference", losses=losses, params=params_of(model))

runs = {
    "dp": loom.DataParallel(allreduce="native"),
    "local_sgd": loom.LocalSGD(sync_every=1, allreduce="native"),
    "local_sgd_ring": loom.LocalSGD(sync_every=1, allreduce="ring"),
    "diloco": loom.DiLoCo(
        sync_every=1, allreduce="native", outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0)
    ),
    **{
        f"diloco_{c}": loom.DiLoCo(
            sync_every=1, compression=c, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0)
        )
        for c in ("fp16", "bf16", "int8")
    },
}
for case, strategy in runs.items():
    job, losses = train(strategy)
    emit(case, losses=losses, params=params_of(job.module))

# Fragments: H=4, F=2, one step of overlap; every exchange's (fragment, sent, applied) over 13 steps.
job, _ = train(loom.DiLoCo(sync_every=4, fragments=2, allreduce="native"), 13)
emit(
    "fragments", log=job.sync_log, names=job.fragment_names, all=[n for n, _ in job.module.named_parameters()]
)
job.close()

# Bytes of one outer exchange of the whole model (one step, then synchronize) with each compression.
for compression in (None, "fp16", "bf16", "int8"):
    strategy = loom.DiLoCo(sync_every=2, compression=compression, allreduce="native")
    job, _ = train(strategy, 1, lambda: nn.Sequential(nn.Linear(8, 512), nn.Linear(512, 4)))
    before = counters().snapshot()
    job.synchronize()
    after = counters().snapshot()
    emit(
        f"bytes_{compression}",
        sent=after["bytes_sent"] - before["bytes_sent"],
        numel=sum(p.numel() for p in job.module.parameters()),
    )
