"""Scripts as users write them, run under ``loom run --on-worker-failure heal`` by tests/test_heal_probe.py.

``heal_probe_train.py MODE OUT``: a float64 MLP, Adam, 256 samples in global batches of 32 (8 steps an epoch),
``HP_EPOCHS`` epochs. MODE ``fit``: ``loom.fit(job, loader, epochs=..., checkpoint_dir=HP_CKPT,
checkpoint_every=5)`` (the README's script); ``loop``: an own loop ``for epoch in range(loader.epoch, EPOCHS)``
over ``job.loader`` with ``job.train_step``, printing on rank 0 only; ``loop0``: the same loop counted from 0,
which a replacement (it starts at the committed step) runs past the job's end; ``sampler``: the loop from 0
over a ``DataLoader`` with a ``DistributedSampler`` (each rank's share); ``dataloader``: over a plain
``DataLoader`` of whole global batches. ``HP_STRATEGY=localsgd``: LocalSGD(sync_every=4), else DataParallel.
``HP_LIE=1``: a replacement
claims the committed step 1,000,000 when it joins. ``HP_DIE_IN_SAVE=S``: a first process that writes the
checkpoint of step S kills itself (SIGKILL) after writing its file, before publishing the manifest. Each process writes its pid once
it has trained ``HP_MARK_STEP`` steps (``OUT/pid.RANK.GEN``, for the test's ``kill -9``) and, at the end, its
step and final parameters (``OUT/final.RANK.GEN.json``). Each training forward rests ``HP_PAUSE_S``, and
under heal, while a member is missing, waits for its replacement to be ready (so that it joins before the end). Run alone
(plain ``python``) it is the one-process reference on the same global batches.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import loom

mode, out = sys.argv[1], Path(sys.argv[2])
EPOCHS = int(os.environ.get("HP_EPOCHS", "8"))
PAUSE_S = float(os.environ.get("HP_PAUSE_S", "0"))
MARK_STEP = int(os.environ.get("HP_MARK_STEP", "3"))

topo = loom.init()
rank, gen = topo.rank, int(os.environ.get("LOOM_HEAL_GENERATION", "0") or 0)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(
    torch.randn(256, 8, generator=g, dtype=torch.float64),
    torch.randn(256, 4, generator=g, dtype=torch.float64),
)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
if os.environ.get("HP_LIE") and gen > 0:  # a replacement that claims a committed step far ahead
    from loom.parallel.data.data_parallel import DataParallelJob

    honest = DataParallelJob._adopt_epoch

    def lying(self: DataParallelJob) -> None:
        self._synced, self.step = True, 1_000_000
        honest(self)

    DataParallelJob._adopt_epoch = lying  # type: ignore[method-assign]
strategy = loom.LocalSGD(sync_every=4) if os.environ.get("HP_STRATEGY") == "localsgd" else loom.DataParallel()
job = strategy.setup(model, optimizer, nn.functional.mse_loss)


def pace(module: nn.Module, _args: object) -> None:
    if module.training:
        if job.step >= MARK_STEP and not (out / f"pid.{rank}.{gen}").exists():
            (out / f"port.{rank}.{gen}").write_text(os.environ.get("MASTER_PORT", ""))  # the job's store
            (out / f"pid.{rank}.{gen}").write_text(str(os.getpid()))
        time.sleep(PAUSE_S)
        quorum = getattr(
            job, "quorum", None
        )  # under heal: while a member is missing, wait (60 s at most) for
        deadline = (
            time.monotonic() + 60
        )  # its replacement to be ready, so that it joins however slow its start
        while quorum is not None and quorum.size < topo.world_size and time.monotonic() < deadline:
            if quorum.join_pending():
                break
            time.sleep(0.05)


model.register_forward_pre_hook(pace)
DIE_IN_SAVE = int(os.environ.get("HP_DIE_IN_SAVE", "0"))
if DIE_IN_SAVE and gen == 0:  # the checkpoint's writer SIGKILLed after its file, before the manifest
    import signal

    from loom.train import fit_checkpoint

    publish = fit_checkpoint.publish

    def dying_publish(directory: Path, staging: Path, step: int, *args: object, **kwargs: object) -> Path:
        if step == DIE_IN_SAVE:
            os.kill(os.getpid(), signal.SIGKILL)
        return publish(directory, staging, step, *args, **kwargs)  # type: ignore[arg-type]

    fit_checkpoint.publish = dying_publish  # type: ignore[assignment]
if mode == "sampler":  # the DDP tutorial's loader: this rank's share of each batch of 32
    sampler = torch.utils.data.DistributedSampler(data, topo.world_size, topo.rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=32 // topo.world_size, sampler=sampler)
elif mode == "dataloader":  # a DataLoader of whole global batches, the same in every process
    loader = torch.utils.data.DataLoader(data, batch_size=32)
else:
    loader = job.loader(data, global_batch_size=32, seed=0)
if mode == "fit":
    result = loom.fit(job, loader, epochs=EPOCHS, checkpoint_dir=os.environ["HP_CKPT"], checkpoint_every=5,
                      keep=int(os.environ.get("HP_KEEP", "3")), progress=False)  # fmt: skip
    print(f"fit: {result.steps} steps, resumed from {result.resumed_from}", flush=True)
else:
    loss = float("nan")
    for epoch in range(loader.epoch if mode == "loop" else 0, EPOCHS):  # (a DataLoader has no epoch)
        for batch in loader:
            loss = job.train_step(batch)
        if rank == 0:
            print(f"epoch {epoch} loss {loss:.6f} step {job.step}", flush=True)
final = {"step": job.step, "params": [p.detach().reshape(-1).tolist() for p in model.parameters()]}
(out / f"final.{rank}.{gen}.json").write_text(json.dumps(final))
