"""Stages that sleep a fixed time per micro-batch (forward and backward): print the measured pipeline bubble.

One JSON line per (schedule, m): the measured idle fraction of the whole pipeline (best of 2..5 steps), this
stage's peak micro-batches and bytes of activations alive, and per step the pipeline's idle fraction with this
stage's busy time and the idle seconds its step record reports (``bubble_s``).
"""

import json
import sys
import time

import torch
from torch import nn

import loom
from loom.mesh import Mesh
from loom.strategies.pipeline import Pipeline
from loom.strategies.pipeline_schedule import bubble_fraction


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepStage(nn.Module):
    """A stage that takes ``seconds`` in forward and in backward, whatever the micro-batch size."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seconds = seconds

    def forward(self, x):
        return _Sleep.apply(self.linear(x), self.seconds)


seconds = float(sys.argv[1])
topo = loom.init()
p = topo.world_size
mesh = Mesh(pp=p)
x, y = torch.randn(16, 4), torch.randn(16, 4)
for schedule in ("gpipe", "1f1b"):
    for m in (1, 2, 4, 8):
        torch.manual_seed(0)
        model = nn.Sequential(*[SleepStage(seconds) for _ in range(p)])
        job = Pipeline(stages=p, microbatches=m, schedule=schedule, mesh=mesh).setup(
            model, torch.optim.SGD(model.parameters(), lr=0.01), nn.functional.mse_loss
        )
        if (schedule, m) == ("gpipe", 1):
            job.train_step((x, y))  # the process's first step warms up threads and allocators
            job.bubble.clear()
        # Best of 2..5 steps: other processes on the machine only ever add idle time (late wake-ups), so the
        # smallest measurement is the closest to the pipeline's own; every rank sees the same gathered value.
        theory = bubble_fraction(p, m)
        while len(job.bubble) < 2 or (len(job.bubble) < 5 and min(job.bubble) > 1.05 * theory):
            job.train_step((x, y))
        stats = job.stage_stats[-1]
        measured = len(job.bubble)  # the steps after the warm-up, each with its step record and stage stats
        per_step = [
            {"bubble": b, "bubble_s": r.bubble_s, "busy_s": s.busy_s, "time_s": r.time_s}
            for b, r, s in zip(
                job.bubble, job.metrics.records[-measured:], job.stage_stats[-measured:], strict=True
            )
        ]
        record = {"schedule": schedule, "m": m, "bubble": min(job.bubble), "steps": len(job.bubble),
                  "busy_s": stats.busy_s, "span_s": stats.span_s, "peak_live": stats.peak_live_microbatches,
                  "peak_bytes": stats.peak_activation_bytes, "per_step": per_step}  # fmt: skip
        print(json.dumps(record), flush=True)
