"""Train the shared MLP under `loom.observe`: ``observe_run.py OUT STEPS MODE...``.

Modes: ``plain`` (records into ``LOOM_RUN_DIR`` as under ``loom run``, traced if ``LOOM_TRACE_STEPS`` is set),
``data`` (rank 1 sleeps 30 ms before each step: a slow loader), ``compute`` (rank 1's forward sleeps 30 ms).
Rank 0 prints one JSON line per mode: the straggler warnings it raised once its watch judged the last steps.

Run by tests/test_observe.py, tests/test_report.py.
"""

import json
import os
import sys
import time
from dataclasses import asdict

import torch
from common import judged_stragglers, make_dataset, make_mlp
from torch import nn

import loom

DELAY_S = 0.03


class SlowForward(nn.Module):
    """The MLP, with a sleep in forward on the slowed rank (a slow GPU, a hot CPU)."""

    def __init__(self, inner: nn.Module, delay_s: float) -> None:
        super().__init__()
        self.inner, self.delay_s = inner, delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s and self.training:
            time.sleep(self.delay_s)
        return self.inner(x)


def train(mode: str, out: str, steps: int, topo) -> None:
    slow = topo.rank == 1
    model = SlowForward(make_mlp(), DELAY_S if mode == "compute" and slow else 0.0)
    trace_steps = os.environ.pop("LOOM_TRACE_STEPS", None) if mode != "plain" else None
    path = None if mode == "plain" else f"{out}/{mode}/metrics/rank{topo.rank}.jsonl"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    job = loom.DataParallel(metrics_path=path).setup(model, optimizer, nn.functional.mse_loss)
    loader = loom.data.loader(make_dataset(), 8, seed=1)
    epoch = 0
    while job.step < steps:
        loader.set_epoch(epoch)
        for batch in loader:
            job.train_step(batch)
            if job.step == steps:
                break
            if mode == "data" and slow:
                time.sleep(DELAY_S)
        epoch += 1
    watch = judged_stragglers(job, topo.is_main)
    job.metrics.close()
    if trace_steps is not None:
        os.environ["LOOM_TRACE_STEPS"] = trace_steps
    if topo.is_main:
        warnings = [asdict(w) for w in watch.warnings]
        print(json.dumps({"mode": mode, "warnings": warnings, "judged_steps": watch.judged_steps,
                          "status": job.metrics.status()}), flush=True)  # fmt: skip


def main() -> None:
    out, steps, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    topo = loom.init()
    for mode in modes:
        train(mode, out, steps, topo)


if __name__ == "__main__":
    main()
