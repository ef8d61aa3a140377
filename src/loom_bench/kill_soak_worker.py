"""The training script of `loom_bench.kill_soak`: a plain DataParallel script, the same under ``loom run`` and alone.

``python -m loom_bench.kill_soak_worker OUT STEPS [--sleep-ms MS]``: a small MLP trained with SGD and momentum on
a fixed synthetic regression set in float64 (so that the sums' order, which differs with the number of
processes, moves the result by ~1e-12 rather than float32's ~1e-5 over thousands of steps), global batch 12, for ``STEPS`` steps, written in terms of ``job.step`` (so a
replacement that joins a running job, with the step and the data position it healed, trains only what is left).
Every 10 steps it prints ``soak rank R pid P step S`` (the soak's driver reads these lines to know each rank's live
process and whether a replacement trains); at the end each process writes its parameters to
``OUT/final_rank{R}.safetensors`` (``OUT/final_single.safetensors`` when run alone: the one-process reference).
``--sleep-ms`` pauses after each step, so that a run lasts long enough for the soak's kills. ``--stop-file``: once
that file exists, its number (written whole, by a rename) becomes the last step; the driver writes it after its last
kill, far enough ahead that every rank reads it before that step.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import loom

GLOBAL_BATCH = 12


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(600, 8, generator=generator)
    y = x @ torch.randn(8, 2, generator=generator) + 0.1 * torch.randn(600, 2, generator=generator)
    return torch.utils.data.TensorDataset(x.double(), y.double())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--stop-file", type=Path, default=None)
    args = parser.parse_args(argv)
    topo = loom.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = loom.DataParallel().setup(model, optimizer, nn.functional.mse_loss)
    loader = job.loader(dataset(), GLOBAL_BATCH, seed=1)
    pid, last = os.getpid(), args.steps
    while job.step < last:
        for batch in loader:
            job.train_step(batch)
            if job.step % 10 == 0:
                print(f"soak rank {topo.rank} pid {pid} step {job.step}", flush=True)
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1000)
            if last == args.steps and args.stop_file is not None and args.stop_file.exists():
                last = min(last, int(args.stop_file.read_text()))
            if job.step >= last:
                break
    name = f"final_rank{topo.rank}" if topo.is_distributed else "final_single"
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / f".{name}.partial"
    save_file({k: v.detach().contiguous() for k, v in job.module.state_dict().items()}, str(partial))
    partial.rename(args.out / f"{name}.safetensors")
    loom.shutdown()


if __name__ == "__main__":
    main()
