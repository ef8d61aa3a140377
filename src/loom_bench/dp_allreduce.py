"""DDP with loom's gradient all-reduce hooks vs raw DDP, 2 workers on this host, plus a one-process baseline.

    python -m loom_bench.dp_allreduce [--repetitions 5] [--steps 30] [--configs ddp,overlap_shm,...]

The question (issue 3): does all-reducing gradients with loom's shared-memory algorithm, overlapped with
backward on a communication thread (`loom.comm.ddp_async`), beat DDP's own gloo all-reduce on one host? The
worker (`loom_bench.dp_allreduce_worker`) times each configuration in the same two processes, rotating their
order per repetition, and in the same rotation one process alone (rank 0, the other waiting): the baseline. Figures are medians over repetitions:
throughput, ratio to raw DDP, scaling efficiency (throughput on N workers / (N x one process)).

Writes ``dp_allreduce.md`` and ``dp_allreduce.json`` into ``out_dir``. Limits: a shared 2-core machine; the
figures are as good as its quietness during the run (the per-repetition values are in the JSON).
"""

from __future__ import annotations

import argparse
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

__all__ = ["run_dp_allreduce_benchmark"]

DEFAULT_CONFIGS = "ddp,overlap_shm,overlap_auto,sync_shm,shared_shm"
DESCRIPTIONS = {
    "ddp": "raw DDP (gloo all-reduce, DDP's own overlap)",
    "ddp_view": "raw DDP, gradient_as_bucket_view",
    "overlap_shm": "DDP + overlapped_allreduce_hook('shm')",
    "overlap_auto": "DDP + overlapped_allreduce_hook('auto')",
    "overlap_shm_view": "DDP + overlapped shm, gradient_as_bucket_view",
    "overlap_auto_view": "DDP + overlapped auto, gradient_as_bucket_view",
    "overlap_shm_b2": "DDP + overlapped shm, 2 MB buckets, bucket view",
    "sync_shm": "DDP + allreduce_hook('shm') (synchronous)",
    "no_comm": "DDP, hook without communication (compute-only ceiling)",
    "shared_shm": "no DDP: gradients averaged in shared memory after backward (DataParallel's default here)",
}


def _run_worker(args: list[str], nproc: int, run_dir: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker = ["-m", "loom_bench.dp_allreduce_worker", *args]
    if nproc == 1:
        return subprocess.call([sys.executable, *worker], env=env)
    launch = [sys.executable, "-m", "loom.cli", "run", "-n", str(nproc), "--run-dir", str(run_dir)]
    return subprocess.call([*launch, *worker], env=env)


def run_dp_allreduce_benchmark(
    out_dir: Path | str, repetitions: int = 5, steps: int = 30, configs: str = DEFAULT_CONFIGS, nproc: int = 2
) -> int:
    """Run the benchmark, write the report into ``out_dir``; return a process exit code."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = ["--repetitions", str(repetitions), "--steps", str(steps)]
    with tempfile.TemporaryDirectory(prefix="loom-bench-") as tmp:
        multi = Path(tmp) / "multi.json"
        print(
            f"dp_allreduce: {nproc} workers, {configs} + one_process ({repetitions} repetitions of {steps} steps)"
        )
        if _run_worker([*common, "--configs", configs, "--out", str(multi)], nproc, Path(tmp) / "run") != 0:
            return 1
        m = json.loads(multi.read_text())
    per_rep = m["samples_per_s"]
    median = {k: statistics.median(v) for k, v in per_rep.items()}
    one, ddp = median["one_process"], median["ddp"]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "model": "MLP 784-1024-1024-10, SGD, global batch 256, synthetic data, 1 thread per process",
        "workers": nproc,
        "repetitions": repetitions,
        "steps_per_repetition": steps,
        "auto_policy": m.get("auto_policy"),
        "samples_per_s": per_rep,
        "median_samples_per_s": median,
        "over_raw_ddp": {k: v / ddp for k, v in median.items() if k != "one_process"},
        # Paired within each repetition (same minute of the shared machine), then the median: resists drift.
        "over_raw_ddp_paired": {
            k: statistics.median(a / b for a, b in zip(v, per_rep["ddp"], strict=True))
            for k, v in per_rep.items()
            if k != "one_process"
        },
        "scaling_efficiency": {k: v / (nproc * one) for k, v in median.items() if k != "one_process"},
        "scaling_efficiency_paired": {
            k: statistics.median(a / (nproc * b) for a, b in zip(v, per_rep["one_process"], strict=True))
            for k, v in per_rep.items()
            if k != "one_process"
        },
    }
    (out_dir / "dp_allreduce.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "dp_allreduce.md").write_text(_markdown(summary))
    print(_markdown(summary))
    return 0


def _markdown(r: dict) -> str:
    med, ratio, eff = r["median_samples_per_s"], r["over_raw_ddp"], r["scaling_efficiency"]
    paired, eff_paired = r["over_raw_ddp_paired"], r["scaling_efficiency_paired"]
    rows = [
        f"| {DESCRIPTIONS.get(k, k)} (`{k}`) | {med[k]:.0f} | {ratio[k]:.2f} | {paired[k]:.2f} | {eff[k]:.2f} "
        f"| {eff_paired[k]:.2f} |"
        for k in ratio
    ]
    return "\n".join(
        [
            "# Gradient averaging in data-parallel training: loom's paths vs raw DDP",
            "",
            f"Command: `python -m loom_bench.dp_allreduce --repetitions {r['repetitions']} --steps "
            f"{r['steps_per_repetition']}` ({r['date']}; {r['machine']}).",
            f"Model: {r['model']}. {r['workers']} workers on one host, launched by `loom run`; medians of "
            f"{r['repetitions']} repetitions, configurations rotated within each; the one-process baseline is timed "
            "in the same rotation (rank 0 alone on whole global batches, the other rank blocked in a broadcast).",
            f"`auto` chose: {r['auto_policy']}.",
            "",
            "Paired columns: the ratio within each repetition (same minute of the shared machine), then the "
            "median over repetitions; they resist load that comes and goes better than ratios of medians.",
            "",
            "| configuration | samples/s (median) | vs raw DDP (medians) | vs raw DDP (paired) "
            "| scaling efficiency (medians) | scaling efficiency (paired) |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
            f"| one process | {med['one_process']:.0f} | | | 1.00 (baseline) | |",
            "",
            "Per repetition (samples/s): "
            + "; ".join(
                f"{k}: {', '.join(f'{v:.0f}' for v in vals)}" for k, vals in r["samples_per_s"].items()
            ),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loom_bench.dp_allreduce", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/reports"))
    args = parser.parse_args(argv)
    return run_dp_allreduce_benchmark(args.out_dir, args.repetitions, args.steps, args.configs)


if __name__ == "__main__":
    sys.exit(main())
