"""Stages that sleep a fixed time per micro-batch (forward and backward): print the measured pipeline bubble.

One JSON line per (schedule, m): the measured idle fraction of the whole pipeline (best of 2..10 steps), the
one-way message time measured just before (``message_s``), this stage's peak micro-batches and bytes of
activations alive, and per step the pipeline's idle fraction with this stage's busy time and the idle seconds
its step record reports (``bubble_s``).

Run by tests/test_pipeline_bubble.py.
"""

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import loom
from loom.mesh import Mesh
from loom.parallel.pipeline.pipeline import Pipeline
from loom.parallel.pipeline.pipeline_communications import recv_gradients, recv_tensors, send_tensors
from loom.parallel.pipeline.pipeline_schedule import simulate


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


def message_time(rank: int, stages: int, rows: int, rounds: int = 15) -> float:
    """One-way time of a stage-to-stage message now, on this machine: the mean over the stage boundaries of half
    the median round trip of an activation message (header and tensor, as the runtime sends it) answered by its
    gradient. A loaded machine makes every blocked receive wake up later; the theory leaves this cost out."""
    times = []
    for boundary in range(stages - 1):
        dist.barrier()
        if rank not in (boundary, boundary + 1):
            continue
        activation = torch.randn(rows, 4)
        for _ in range(rounds):
            t0 = time.perf_counter()
            if rank == boundary:
                for handle, _t in send_tensors([activation], rank + 1):
                    handle.wait()
                recv_gradients([activation], rank + 1)
            else:
                received = recv_tensors(rank - 1, torch.device("cpu"))
                for handle, _t in send_tensors(received, rank - 1, with_header=False):
                    handle.wait()
            times.append(time.perf_counter() - t0)
    dist.barrier()
    total = torch.tensor([statistics.median(times) / 2 if times else 0.0, 1.0 if times else 0.0])
    dist.all_reduce(total)
    return float(total[0] / total[1])


seconds = float(sys.argv[1])
topo = loom.init()
p = topo.world_size
mesh = Mesh(pp=p)
torch.manual_seed(1)  # every stage of the pipeline holds the same batch (the job checks)
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
        # Best of 2..10 steps: other processes on the machine only ever add idle time (late wake-ups), so the
        # smallest measurement is the closest to the pipeline's own; every rank sees the same gathered value. The
        # target is the schedule replayed with the message time measured just before (equal on all ranks).
        latency = message_time(topo.rank, p, len(x) // m)
        expected = simulate(schedule, p, m, seconds, seconds, message_time=latency).bubble
        while len(job.bubble) < 2 or (len(job.bubble) < 10 and min(job.bubble) > 1.03 * expected):
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
                  "message_s": latency,
                  "busy_s": stats.busy_s, "span_s": stats.span_s, "peak_live": stats.peak_live_microbatches,
                  "peak_bytes": stats.peak_activation_bytes, "per_step": per_step}  # fmt: skip
        print(json.dumps(record), flush=True)
