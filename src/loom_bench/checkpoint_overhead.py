"""``loom bench checkpoint``: step-time overhead of synchronous and asynchronous checkpoints, against none.

One process trains the same model with `loom.fit` three ways -- no checkpoint (the baseline), a synchronous
checkpoint every ``every`` steps, an asynchronous one every ``every`` steps -- interleaved repetition by
repetition so the three share the machine's state, and reports medians: mean step time of each (checkpoint
time included: a synchronous save stalls the step after which it is taken) and the overhead relative to the
baseline. A second panel shows the per-step times of one repetition, where the synchronous saves stand out.

Limits: one process, so it measures the writer's cost; in a data-parallel job the other ranks wait for rank 0 at
the checkpoint's agreement all-gather, so the job pays the same stall. The asynchronous save still copies the
state (the snapshot) on the training thread and shares the cores with it while writing; with fewer steps
between checkpoints than one write takes, the next save waits for the previous one. The disk is the one
holding the system's temporary directory.

Writes ``checkpoint_overhead.{png,md,json}`` into the report directory.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["run_checkpoint_benchmark", "measure_checkpoint_overhead"]

MODES = ("none", "sync", "async")


def _one_run(mode: str, steps: int, every: int, width: int, scratch: Path) -> list[float]:
    """Per-step wall times (seconds) of one `fit` run; a step's time includes any save taken right after it."""
    import loom
    from loom.topology import Topology

    single = Topology(0, 1, 0, 1, "none")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    job = loom.DataParallel(topology=single).setup(model, optimizer, nn.functional.mse_loss)
    data = torch.utils.data.TensorDataset(torch.randn(64 * steps, width), torch.randn(64 * steps, width))
    loader = loom.data.loader(data, 64, seed=0, topology=single)
    stamps: list[float] = []
    train_step = job.train_step

    def timed_step(batch: Any) -> float:
        stamps.append(time.perf_counter())
        return train_step(batch)

    job.train_step = timed_step  # type: ignore[method-assign]
    directory = None if mode == "none" else tempfile.mkdtemp(prefix=f"ckpt-{mode}-", dir=scratch)
    fit_args: dict[str, Any] = {"checkpoint_every": every, "keep": 2, "async_checkpoint": mode == "async"}
    loom.fit(
        job, loader, steps=steps, checkpoint_dir=directory, progress=False, **(fit_args if directory else {})
    )
    stamps.append(time.perf_counter())  # fit waits for the last asynchronous save before returning
    return [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]


def measure_checkpoint_overhead(
    repetitions: int = 5, steps: int = 40, every: int = 10, width: int = 1024
) -> dict[str, Any]:
    """The measurements: per mode, the mean step time of each repetition and one repetition's step times."""
    means: dict[str, list[float]] = {m: [] for m in MODES}
    stalls: dict[str, list[float]] = {m: [] for m in MODES}
    traces: dict[str, list[float]] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="loom-bench-ckpt-") as scratch:
        for mode in MODES:  # warm-up: allocator, first-write costs
            _one_run(mode, every + 2, every, width, Path(scratch))
        for rep in range(repetitions):
            for mode in MODES:
                times = _one_run(mode, steps, every, width, Path(scratch))
                means[mode].append(statistics.fmean(times))
                saving = [t for i, t in enumerate(times) if (i + 1) % every == 0]
                others = [t for i, t in enumerate(times) if (i + 1) % every != 0]
                stalls[mode].append(statistics.median(saving) - statistics.median(others))
                if rep == repetitions // 2:
                    traces[mode] = times
    params = 2 * width * 2 * width + 3 * width
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "repetitions": repetitions,
        "steps": steps,
        "every": every,
        "parameters": params,
        "checkpoint_mb": round(params * 4 * 3 / 2**20, 1),  # parameters + Adam's two moments, float32
        "mean_step_s": means,
        "median_step_s": {m: statistics.median(v) for m, v in means.items()},
        "median_stall_s": {m: statistics.median(v) for m, v in stalls.items()},
        "trace_step_s": traces,
    }


def _overheads(result: dict[str, Any]) -> dict[str, float]:
    base = result["median_step_s"]["none"]
    return {m: result["median_step_s"][m] / base - 1 for m in MODES}


def _figure(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    over = _overheads(result)
    fig, (bars, trace) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 2]})
    medians = [result["median_step_s"][m] * 1e3 for m in MODES]
    colors = ["#888888", "#d62728", "#1f77b4"]
    bars.bar(MODES, medians, color=colors)
    for i, m in enumerate(MODES):
        spread = [t * 1e3 for t in result["mean_step_s"][m]]
        bars.plot([i] * len(spread), spread, "k.", markersize=4)
        label = "baseline" if m == "none" else f"{over[m]:+.0%}"
        bars.annotate(
            label, (i, medians[i]), ha="center", va="bottom", xytext=(0, 3), textcoords="offset points"
        )
    bars.set_ylabel("mean step time (ms), median of repetitions")
    bars.set_title(f"checkpoint every {result['every']} steps ({result['checkpoint_mb']} MB)")
    for m, color in zip(MODES, colors, strict=True):
        trace.plot(range(1, len(result["trace_step_s"][m]) + 1), [t * 1e3 for t in result["trace_step_s"][m]],
                   label=m, color=color, marker=".")  # fmt: skip
    trace.set_yscale("log")
    trace.set_xlabel("step")
    trace.set_ylabel("step time (ms, log)")
    trace.set_title("one repetition: a step's time includes the save after it")
    trace.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(result: dict[str, Any]) -> str:
    over = _overheads(result)
    rows = "\n".join(
        f"| {m} | {result['median_step_s'][m] * 1e3:.1f} | "
        f"{'baseline' if m == 'none' else f'{over[m]:+.1%}'} | {result['median_stall_s'][m] * 1e3:.0f} |"
        for m in MODES
    )
    return f"""# Checkpoint overhead: synchronous and asynchronous saves vs none

`loom bench checkpoint`, {result["date"]}, torch {result["torch"]}, {result["machine"]}, {result.get("cpus")} CPUs,
load average {result.get("load_average")} (before, after: the machine was shared with other jobs).

One process trains with `loom.fit`: an MLP of {result["parameters"]:,} parameters with Adam (a checkpoint of
{result["checkpoint_mb"]} MB), {result["steps"]} steps per run, a checkpoint every {result["every"]} steps. The three
modes are interleaved, {result["repetitions"]} repetitions; the step time is the median over repetitions of each
run's mean step time (saves included). The stall is how much longer the step after which a checkpoint is taken
lasts than the median step of its run (median over repetitions).

| mode | step time (ms) | overhead vs none | stall at a checkpoint step (ms) |
|---|---|---|---|
{rows}

![checkpoint overhead](checkpoint_overhead.png)

The synchronous save stalls the step after which it is taken for the whole write (serialize, fsync, rename);
the asynchronous one stalls it only for the snapshot copy and then writes while training continues. The write
still costs CPU time: when the cores are busy (as here, 2 cores under load) the steps that overlap it slow
down, and the end-to-end saving over the synchronous save is small; with an idle core it approaches the stall
difference. Absolute times vary with the machine's load; the three modes come from the same run.
"""


def run_checkpoint_benchmark(out_dir: Path, repetitions: int = 5, steps: int = 40, every: int = 10) -> int:
    """Measure, then write ``checkpoint_overhead.{png,md,json}`` into ``out_dir``; returns an exit status."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"loom bench checkpoint: none / sync / async every {every} steps, {repetitions} repetitions")
    result = measure_checkpoint_overhead(repetitions, steps, every)
    (out_dir / "checkpoint_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    _figure(result, out_dir / "checkpoint_overhead.png")
    (out_dir / "checkpoint_overhead.md").write_text(_markdown(result))
    for mode, value in _overheads(result).items():
        step_ms, stall_ms = result["median_step_s"][mode] * 1e3, result["median_stall_s"][mode] * 1e3
        print(f"  {mode:5s} {step_ms:8.1f} ms/step  overhead {value:+.1%}  stall {stall_ms:.0f} ms")
    print(f"loom bench checkpoint: wrote {out_dir / 'checkpoint_overhead.md'} and .png")
    return 0
