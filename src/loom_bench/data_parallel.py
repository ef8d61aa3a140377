"""``loom bench dp``: loom DataParallel vs raw DistributedDataParallel, 2 workers, plus a one-process baseline.

Reports medians over repetitions: throughput of each, their ratio (loom / DDP), and scaling efficiency
(throughput on N workers / (N x one process)). All figures come from one invocation, so they share the machine's
state. Writes ``dp_vs_ddp.md`` and ``dp_vs_ddp.json`` into the report directory.
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

__all__ = ["run_benchmark", "summarize"]


def _worker(args: list[str], nproc: int, run_dir: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "loom_bench.dp_worker", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "loom.cli",
            "run",
            "-n",
            str(nproc),
            "--run-dir",
            str(run_dir),
            "-m",
            "loom_bench.dp_worker",
            *args,
        ]
    return subprocess.call(cmd, env=env)


def run_benchmark(repetitions: int, steps: int, out_dir: Path, nproc: int = 2) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="loom-bench-") as tmp:
        common = ["--repetitions", str(repetitions), "--steps", str(steps)]
        multi, single = Path(tmp) / "multi.json", Path(tmp) / "single.json"
        print(f"loom bench dp: {nproc} workers, loom DataParallel vs raw DDP ({repetitions} repetitions)")
        if _worker([*common, "--out", str(multi)], nproc, Path(tmp) / "run") != 0:
            return 1
        print("loom bench dp: one process, the scaling baseline")
        if _worker([*common, "--out", str(single)], 1, Path(tmp) / "run1") != 0:
            return 1
        m, s = json.loads(multi.read_text()), json.loads(single.read_text())
    summary = summarize(m, s, nproc, repetitions, steps)
    (out_dir / "dp_vs_ddp.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "dp_vs_ddp.md").write_text(_markdown(summary))
    print(_markdown(summary))
    return 0


def summarize(m: dict, s: dict, nproc: int, repetitions: int, steps: int) -> dict:
    """The report's figures from the workers' samples/s: ``m`` of the multi-process job (loom,
    loom_unobserved, ddp), ``s`` of the one-process job (its ``ddp`` is the plain model)."""
    loom_tp, ddp_tp, one_tp = (statistics.median(v) for v in (m["loom"], m["ddp"], s["ddp"]))
    quiet_tp = statistics.median(m["loom_unobserved"])
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "model": "MLP 784-1024-1024-10, SGD, global batch 256, synthetic data, 1 thread per process",
        "workers": nproc,
        "repetitions": repetitions,
        "steps_per_repetition": steps,
        "samples_per_s": {
            "loom": m["loom"],
            "loom_unobserved": m["loom_unobserved"],
            "ddp": m["ddp"],
            "one_process": s["ddp"],
        },
        "median_samples_per_s": {
            "loom": loom_tp,
            "loom_unobserved": quiet_tp,
            "ddp": ddp_tp,
            "one_process": one_tp,
        },
        "loom_over_ddp": loom_tp / ddp_tp,
        "loom_unobserved_over_ddp": quiet_tp / ddp_tp,
        "paired_over_ddp": {  # the median of each repetition's own ratio (loom and DDP timed seconds apart)
            name: statistics.median(a / b for a, b in zip(m[name], m["ddp"], strict=True))
            for name in ("loom", "loom_unobserved")
        },
        "scaling_efficiency": {
            "loom": loom_tp / (nproc * one_tp),
            "loom_unobserved": quiet_tp / (nproc * one_tp),
            "ddp": ddp_tp / (nproc * one_tp),
        },
    }
    return summary


def _markdown(r: dict) -> str:
    med, eff, paired = r["median_samples_per_s"], r["scaling_efficiency"], r["paired_over_ddp"]
    return "\n".join(
        [
            "# loom DataParallel vs raw DistributedDataParallel",
            "",
            f"Command: `loom bench dp --repetitions {r['repetitions']} --steps {r['steps_per_repetition']}` "
            f"({r['date']}; {r['machine']}).",
            f"Model: {r['model']}. {r['workers']} workers on one host (gloo), medians of {r['repetitions']} "
            "repetitions; the order of loom, loom without metrics and DDP rotates between repetitions.",
            "",
            "vs raw DDP: the ratio of the medians, and the median of each repetition's own ratio (paired: "
            "loom and DDP timed in the same repetition, seconds apart, so slow minutes hit both).",
            "",
            "| | samples/s (median) | vs raw DDP (medians) | vs raw DDP (paired) | scaling efficiency |",
            "|---|---:|---:|---:|---:|",
            f"| loom DataParallel | {med['loom']:.0f} | {r['loom_over_ddp']:.3f} | {paired['loom']:.3f} | "
            f"{eff['loom']:.2f} |",
            f"| loom DataParallel, `observe=False` | {med['loom_unobserved']:.0f} | "
            f"{r['loom_unobserved_over_ddp']:.3f} | {paired['loom_unobserved']:.3f} | {eff['loom_unobserved']:.2f} |",
            f"| raw DDP | {med['ddp']:.0f} | 1.000 | 1.000 | {eff['ddp']:.2f} |",
            f"| one process | {med['one_process']:.0f} | | | 1.00 (baseline) |",
            "",
            "Per repetition (samples/s): "
            + "; ".join(
                f"{k}: {', '.join(f'{v:.0f}' for v in vals)}" for k, vals in r["samples_per_s"].items()
            ),
            "",
        ]
    )
