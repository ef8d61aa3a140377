"""``loom bench sharded``: ZeRO memory predicted vs measured, and throughput against raw FSDP2 and DataParallel.

For each world size N, one job (`loom_bench.sharded_worker`) runs loom ShardedDataParallel at stages 1, 2 and 3,
raw FSDP2 (``fully_shard`` with the same units, a plain loop) at stages 2 and 3, and loom DataParallel,
alternating within every repetition. Memory: each rank's persistent training state (parameters, gradients,
Adam's state) counted over the live tensors after training, against the ZeRO share of the one-process state
(16 bytes per parameter: `loom.parallel.data.sharded_memory.zero_share`). Throughput: medians over repetitions.
Writes ``sharded.md``, ``sharded.json`` and ``sharded.png`` (memory per rank, predicted and measured, and
throughput against N) into the report directory; ``python -m loom_bench.sharded --figure DIR`` redraws the
figure from ``DIR/sharded.json`` without running anything.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from loom.parallel.data.sharded_memory import zero_share

__all__ = ["run_sharded_benchmark"]


def _job(nproc: int, args: list[str], run_dir: Path) -> int:
    # A fixed mmap threshold: glibc then maps every allocation above 128 KiB on its own and unmaps it when freed,
    # so the resident set follows the live tensors and a step's peak shows in VmHWM (its default threshold grows
    # with the allocations and keeps freed memory resident). The same for every runner.
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    cmd = [sys.executable, "-m", "loom.cli", "run", "-n", str(nproc), "--run-dir", str(run_dir)]
    return subprocess.call([*cmd, "-m", "loom_bench.sharded_worker", *args], env=env)


def run_sharded_benchmark(repetitions: int, steps: int, out_dir: Path, world_sizes=(2, 3, 4)) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="loom-bench-") as tmp:
        for n in world_sizes:
            out = Path(tmp) / f"n{n}.json"
            print(f"loom bench sharded: {n} processes, {repetitions} repetitions", flush=True)
            args = ["--repetitions", str(repetitions), "--steps", str(steps), "--out", str(out)]
            if _job(n, args, Path(tmp) / f"run{n}") != 0:
                return 1
            results[n] = json.loads(out.read_text())
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "model": "MLP 784-1024-1024-10, Adam, global batch 240, synthetic data, 1 thread per process",
        "repetitions": repetitions,
        "steps": steps,
        "results": {str(n): r for n, r in results.items()},
    }
    (out_dir / "sharded.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary) + "\n![memory per rank and throughput](sharded.png)\n"
    (out_dir / "sharded.md").write_text(text)
    figure(summary, out_dir / "sharded.png")
    print(text)
    return 0


def _stage(name: str) -> int | None:
    return int(name.split("stage ")[1][0]) if "stage" in name else None


def markdown(summary: dict) -> str:
    lines = [
        "# ShardedDataParallel: memory per rank and throughput",
        "",
        f"Command: `loom bench sharded --repetitions {summary['repetitions']} --steps {summary['steps']}` "
        f"({summary['date']}; {summary['machine']}). Model: {summary['model']}.",
        "",
        "Memory: each rank's persistent training state (parameters + gradients + optimizer state, rank 0, after "
        "training), counted over every live tensor, each storage once; predicted: the ZeRO share of the "
        "one-process state (16 bytes per parameter with Adam in fp32). DataParallel's prediction is the whole.",
        "",
        "Throughput: the median samples/s over the repetitions, and against raw FSDP2 at the same stage and "
        "against DataParallel the median of each repetition's own ratio (paired: the runners of one repetition "
        "run seconds apart, so a slow minute hits them alike).",
        "",
        "Step peak: how far the process's resident memory rose above its level at the start of one step, at "
        "its highest during the step (Linux ``VmHWM`` reset through ``/proc/self/clear_refs``; rank 0, the "
        "last repetition): gathered parameters, full gradients, activations, communication buffers.",
        "",
        "| N | runner | predicted MiB | measured MiB | measured / predicted | step peak MiB | samples/s (median) | "
        "vs raw FSDP2 (paired) | vs DataParallel (paired) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mib = 1 << 20
    for n, r in summary["results"].items():
        whole = 16 * r["params"]
        rates = r["rates"]

        def paired(a: str, b: str, rates=rates) -> float:
            return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))

        for name, values in rates.items():
            stage = _stage(name)
            predicted = whole * (zero_share(stage, int(n)) if stage else 1.0)
            measured = r["memory"][name]["state"]
            raw = f"raw FSDP2 stage {stage}"
            vs_raw = f"{paired(name, raw):.2f}" if raw in rates and name.startswith("loom") else ""
            lines.append(
                f"| {n} | {name} | {predicted / mib:.1f} | {measured / mib:.1f} | {measured / predicted:.2f} | "
                f"{r['memory'][name].get('step_peak', 0) / mib:.1f} | {statistics.median(values):.0f} | {vs_raw} | {paired(name, 'loom DataParallel'):.2f} |"
            )
    lines += [
        "",
        "Per repetition (samples/s): "
        + "; ".join(
            f"N={n} {k}: {', '.join(f'{v:.0f}' for v in vals)}"
            for n, r in summary["results"].items()
            for k, vals in r["rates"].items()
        ),
        "",
    ]
    return "\n".join(lines)


def figure(summary: dict, path: Path) -> None:
    """Left: each runner's persistent state per rank (measured, solid; the ZeRO prediction, dotted) against N;
    right: its median samples/s against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = summary["results"]
    sizes = sorted(results, key=int)
    names = list(results[sizes[0]]["rates"])
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(names):
        color = f"C{i}"
        stage = _stage(name)
        measured = [results[n]["memory"][name]["state"] / (1 << 20) for n in sizes]
        predicted = [
            16 * results[n]["params"] * (zero_share(stage, int(n)) if stage else 1.0) / (1 << 20)
            for n in sizes
        ]
        memory.plot([int(n) for n in sizes], measured, "o-", color=color, label=name)
        memory.plot([int(n) for n in sizes], predicted, ":", color=color)
        speed.plot([int(n) for n in sizes], [statistics.median(results[n]["rates"][name]) for n in sizes], "o-",
                   color=color, label=name)  # fmt: skip
    memory.set(xlabel="processes N", ylabel="training state per rank (MiB)",
               title="memory per rank: measured (solid), ZeRO share (dotted)", xticks=[int(n) for n in sizes])  # fmt: skip
    speed.set(xlabel="processes N", ylabel="samples/s (median)", title="throughput",
              xticks=[int(n) for n in sizes])  # fmt: skip
    for ax in (memory, speed):
        ax.grid(True, alpha=0.3)
    speed.legend(fontsize=8)
    fig.suptitle(f"ShardedDataParallel, {summary['model']} ({summary['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--figure"]:
        folder = Path(sys.argv[2])
        figure(json.loads((folder / "sharded.json").read_text()), folder / "sharded.png")
        sys.exit(0)
    sys.exit(run_sharded_benchmark(5, 10, Path("benchmarks/reports")))
