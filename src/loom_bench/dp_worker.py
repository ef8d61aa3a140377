"""Worker of ``loom bench dp``: loom DataParallel, the same without metrics, raw DistributedDataParallel and one
process, timed in turn in the same processes.

All train the same MLP (`MODELS`: ~1.9 M, ~25 M or ~100 M parameters) on the same synthetic global batches with
SGD. Each of the three multi-process jobs is set up once and lives for the whole run (a 100 M model's setup costs
seconds), and every repetition times each job in turn, rotating which goes first, so drift on a shared machine
hits all of them alike. The one-process baseline is timed in the same rotation, by rank 0 alone on the whole
global batch while the other ranks wait at a barrier (blocked, not spinning), so the scaling efficiency is paired
too. Without a process group (``python -m loom_bench.dp_worker`` directly) only the plain model is timed. Rank 0
writes the per-repetition throughputs as JSON.

Only the public API that every compared commit has is used (``loom.DataParallel(observe=...)``,
``loom.data.loader``), so `loom_bench.compare_commits` times old and new code with this worker.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import loom
from loom.data import share_bounds

MODELS = {"1.9m": (1024, 1024), "25m": (4608, 4608), "100m": (7000, 7000, 7000)}
"""Hidden widths of the benchmark MLP 784-...-10 by its size: 1.86 M, 24.9 M and 103.5 M parameters."""


def bench_model(size: str = "1.9m") -> nn.Module:
    """The benchmark MLP of ``size`` (`MODELS`), seeded: the same on every rank and in every job."""
    torch.manual_seed(0)
    widths = [784, *MODELS[size]]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 10))


def parameter_count(size: str) -> int:
    widths = [784, *MODELS[size], 10]
    return sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))


def synthetic_data(global_batch: int, steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = global_batch * steps
    return TensorDataset(torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g))


def time_job(job, data: TensorDataset, global_batch: int, warmup: int) -> float:
    """Samples/s of ``job.train_step`` over ``data`` in global batches, after ``warmup`` untimed steps."""
    batches = list(loom.data.loader(data, global_batch, shuffle=False))
    for batch in batches[:warmup]:
        job.train_step(batch)
    started = time.perf_counter()
    for batch in batches[warmup:]:
        job.train_step(batch)
    return (len(batches) - warmup) * global_batch / (time.perf_counter() - started)


def time_raw_ddp(topo, data: TensorDataset, global_batch: int, warmup: int) -> float:
    """Samples/s of a fresh raw DDP loop (the plain model in one process), after ``warmup`` untimed steps."""
    model = bench_model()
    wrapped = DistributedDataParallel(model) if topo.is_distributed else model
    step = raw_step(wrapped, torch.optim.SGD(model.parameters(), lr=0.01), data, global_batch, topo)
    for i in range(warmup):
        step(i)
    return _timed(step, warmup, len(data) // global_batch, global_batch)


def raw_step(
    wrapped: nn.Module, optimizer, data: TensorDataset, global_batch: int, topo, laps: list | None = None
) -> Callable[[int], None]:
    """One step of the plain training loop on global batch ``i``: this rank's share (``topo`` None: all of it).
    ``laps``: each step appends its (forward, backward, optimizer) seconds; DDP's gradient all-reduce runs
    inside backward, and its un-overlapped tail is part of the backward lap (timing it apart needs a hook,
    which would change DDP's path)."""
    x, y = data.tensors
    lo, hi = share_bounds(global_batch, topo.rank, topo.world_size) if topo is not None else (0, global_batch)
    clock = time.perf_counter

    def step(i: int) -> None:
        base = i * global_batch
        started = clock()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(wrapped(x[base + lo : base + hi]), y[base + lo : base + hi])
        forward = clock()
        loss.backward()
        backward = clock()
        optimizer.step()
        if laps is not None:
            laps.append((forward - started, backward - forward, clock() - backward))

    return step


def _timed(step: Callable[[int], None], first: int, end: int, global_batch: int) -> float:
    started = time.perf_counter()
    for i in range(first, end):
        step(i)
    return (end - first) * global_batch / (time.perf_counter() - started)


PHASES: dict[str, list] = {"loom": [], "ddp": []}
"""Rank 0's phase times per timed step: loom's from its step records (`loom.observe.metrics`: data, compute,
comm, optimizer, the record's step time, the wall time between two ``train_step`` returns seen from outside, and
their difference), DDP's laps."""


def runners(
    topo, size: str, data: TensorDataset, global_batch: int, warmup: int
) -> dict[str, Callable[[], float]]:
    """Each configuration set up once, warmed up, and returned as a call that times one repetition (samples/s)."""
    steps = len(data) // global_batch
    timed: dict[str, Callable[[], float]] = {}
    if topo.is_distributed:
        for name, observe in (("loom", True), ("loom_unobserved", False)):
            model = bench_model(size)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            job = loom.DataParallel(observe=observe).setup(model, optimizer, nn.functional.cross_entropy)
            batches = list(loom.data.loader(data, global_batch, shuffle=False))
            for batch in batches[:warmup]:
                job.train_step(batch)
            timed[name] = _job_timer(job, batches[warmup:], global_batch, PHASES["loom"] if observe else None)
        model = bench_model(size)
        ddp_step = raw_step(DistributedDataParallel(model), torch.optim.SGD(model.parameters(), lr=0.01), data,
                            global_batch, topo, PHASES["ddp"])  # fmt: skip
        for i in range(warmup):
            ddp_step(i)
        PHASES["ddp"].clear()
        timed["ddp"] = lambda: _timed(ddp_step, warmup, steps, global_batch)
    plain = bench_model(size)
    one_step = raw_step(plain, torch.optim.SGD(plain.parameters(), lr=0.01), data, global_batch, None)
    if topo.rank == 0:
        for i in range(warmup):
            one_step(i)
    timed["one_process"] = lambda: _alone_on_rank0(
        topo, lambda: _timed(one_step, warmup, steps, global_batch)
    )
    return timed


def _job_timer(job, batches: list, global_batch: int, phases: list | None) -> Callable[[], float]:
    def run() -> float:
        walls = []
        started = time.perf_counter()
        for batch in batches:
            job.train_step(batch)
            walls.append(time.perf_counter())
        elapsed = time.perf_counter() - started
        if phases is not None:  # after the clock stopped: reading the records is not in the throughput
            records = job.metrics.records[-len(batches) :]
            steps = [b - a for a, b in zip([started, *walls], walls, strict=False)]
            for record, wall in zip(records, steps, strict=True):
                phases.append((record.data_s, record.compute_s, record.comm_s, record.optimizer_s, record.time_s,
                               wall, wall - record.time_s))  # fmt: skip
        return len(batches) * global_batch / elapsed

    return run


def phase_medians() -> dict[str, dict[str, float]]:
    """The median of each phase over every timed step, in seconds (rank 0's view)."""
    names = {
        "loom": ("data_s", "compute_s", "comm_s", "optimizer_s", "record_s", "wall_s", "outside_s"),
        "ddp": ("forward_s", "backward_with_allreduce_s", "optimizer_s"),
    }
    return {
        kind: {
            name: statistics.median(column)
            for name, column in zip(names[kind], zip(*rows, strict=True), strict=True)
        }
        for kind, rows in PHASES.items()
        if rows
    }


def _alone_on_rank0(topo, timer: Callable[[], float]) -> float:
    """Rank 0 times ``timer`` while the other ranks wait at a barrier (0.0 on them)."""
    result = timer() if topo.rank == 0 else 0.0
    if topo.is_distributed:
        dist.barrier()
    return result


def timing_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every loom-vs-DDP worker takes (this one, `loom_bench.strategy_worker`)."""
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def main() -> None:
    parser = timing_arguments(argparse.ArgumentParser())
    parser.add_argument("--model", choices=sorted(MODELS), default="1.9m")
    parser.add_argument("--no-one-process", action="store_true", help="skip the one-process baseline")
    parser.add_argument(
        "--max-seconds", type=float, default=0.0, help="no repetition begins that would end later"
    )
    args = parser.parse_args()
    started = time.monotonic()  # --max-seconds counts the set-up too
    torch.set_num_threads(1)
    topo = loom.init()
    data = synthetic_data(args.global_batch, args.steps + args.warmup)
    timers = runners(topo, args.model, data, args.global_batch, args.warmup)
    if args.no_one_process:
        timers.pop("one_process")
    results: dict[str, list[float]] = {name: [] for name in timers}
    for rep in range(args.repetitions):
        names = list(timers)
        first = rep % len(names)
        rep_started = time.monotonic()
        for name in names[first:] + names[:first]:  # each runs first as often as the others
            results[name].append(timers[name]())
        if topo.is_main:
            print(f"repetition {rep + 1}/{args.repetitions}: "
                  + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()) + " samples/s", flush=True)  # fmt: skip
            _write(
                args.out, topo, results
            )  # after every repetition: a run stopped later keeps what it measured
        if args.max_seconds and rep + 1 < args.repetitions and _out_of_time(topo, started, rep_started, args):
            if topo.is_main:
                print(f"stopping after {rep + 1} repetitions: another would pass --max-seconds", flush=True)
            break


def _out_of_time(topo, started: float, rep_started: float, args: argparse.Namespace) -> bool:
    """Rank 0's verdict, the same on every rank: would one more repetition end after ``--max-seconds``?"""
    now = time.monotonic()
    late = torch.tensor([float(now + 1.2 * (now - rep_started) > started + args.max_seconds)])
    if topo.is_distributed:
        dist.broadcast(late, src=0)
    return bool(late.item())


def _write(out: Path, topo, results: dict[str, list[float]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"world_size": topo.world_size, **results, "phases": phase_medians()}))


if __name__ == "__main__":
    main()
