"""``loom bench dp``: loom DataParallel vs raw DistributedDataParallel vs one process, in one run.

``loom bench dp [-n 2] [--model 1.9m|25m|100m] [--repetitions 5] [--steps 30] [--out benchmarks/reports]``

One ``loom run -n N`` job (`loom_bench.dp_worker`) times, in turn within every repetition: loom DataParallel with
its defaults, the same with ``observe=False``, raw DDP, and the plain model in one process (rank 0 alone). The
report gives each one's median samples/s and, per repetition, the paired ratios: loom / DDP, ``observe=False`` /
DDP, what observing costs (``observe=False`` / loom), and the scaling efficiency (throughput over N x one
process); the medians of those ratios are the figures to judge by, since a slow minute of a shared machine hits
both sides of a pair. The report names the host's cores, torch, the load average before and after, and the
command. Writes ``dp_vs_ddp_<model>_n<N>.md`` and ``.json`` into the report directory.
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

from loom_bench.dp_worker import MODELS, parameter_count

__all__ = ["MODELS", "run_benchmark", "summarize"]

CONFIGS = ("loom", "loom_unobserved", "ddp", "one_process")


def _loadavg() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where there is no ``/proc``)."""
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def command_line(nproc: int, model: str, repetitions: int, steps: int, one_process: bool = True) -> str:
    extra = "" if one_process else " --no-one-process"
    return f"loom bench dp -n {nproc} --model {model} --repetitions {repetitions} --steps {steps}{extra}"


def main(argv: list[str] | None = None) -> int:
    """``python -m loom_bench.data_parallel``: `loom bench dp` with the worker's further options (the many-core
    matrix, ``benchmarks/device/dp_matrix.sh``, bounds each run's time with ``--max-seconds``)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nproc", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="1.9m")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--max-seconds", type=float, default=0.0, help="no repetition begins that would end later"
    )
    parser.add_argument("--no-one-process", action="store_true", help="skip the one-process baseline")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports"))
    ns = parser.parse_args(argv)
    return run_benchmark(ns.repetitions, ns.steps, ns.out, ns.nproc, ns.model, not ns.no_one_process, ns.warmup,
                         ns.max_seconds)  # fmt: skip


def run_benchmark(
    repetitions: int,
    steps: int,
    out_dir: Path,
    nproc: int = 2,
    model: str = "1.9m",
    one_process: bool = True,
    warmup: int = 3,
    max_seconds: float = 0.0,
) -> int:
    """Run the job, write the report; 0 on success (the launcher's exit status otherwise)."""
    if nproc < 2:
        print(
            f"loom bench dp: -n {nproc}: the comparison needs at least 2 workers. HINT: -n 2", file=sys.stderr
        )
        return 2
    if model not in MODELS:
        print(f"loom bench dp: --model {model!r} is not one of {', '.join(MODELS)}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    command = command_line(nproc, model, repetitions, steps, one_process)
    load_before = _loadavg()
    with tempfile.TemporaryDirectory(prefix="loom-bench-") as tmp:
        result = Path(tmp) / "samples.json"
        args = ["--model", model, "--repetitions", str(repetitions), "--steps", str(steps),
                "--warmup", str(warmup), "--max-seconds", str(max_seconds), "--out", str(result),
                *([] if one_process else ["--no-one-process"])]  # fmt: skip
        cmd = [sys.executable, "-m", "loom.cli", "run", "-n", str(nproc), "--run-dir", str(Path(tmp) / "run"),
               "-m", "loom_bench.dp_worker", *args]  # fmt: skip
        print(
            f"loom bench dp: {nproc} workers, model {model}: {', '.join(CONFIGS)} in turn, {repetitions} reps"
        )
        code = subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if code != 0:
            return code
        samples = json.loads(result.read_text())
    done = len(samples["loom"])  # fewer than asked when --max-seconds stopped the run
    summary = summarize(samples, nproc, done, steps, model=model, command=command)
    summary["repetitions_asked"] = repetitions
    summary["load_before"], summary["load_after"] = load_before, _loadavg()
    stem = f"dp_vs_ddp_{model}_n{nproc}"
    (out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    (out_dir / f"{stem}.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


def _paired(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"unpaired repetitions: {len(a)} against {len(b)}")
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def summarize(
    samples: dict, nproc: int, repetitions: int, steps: int, model: str = "1.9m", command: str = ""
) -> dict:
    """The report's figures from the worker's samples/s per repetition (``loom``, ``loom_unobserved``, ``ddp``
    and, unless skipped, ``one_process``): medians, and medians of the per-repetition (paired) ratios."""
    runs = {name: samples[name] for name in CONFIGS if name in samples}
    med = {name: statistics.median(values) for name, values in runs.items()}
    summary: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": command or command_line(nproc, model, repetitions, steps, "one_process" in runs),
        "host": {
            "machine": platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "model": f"MLP 784-{'-'.join(map(str, MODELS[model]))}-10 ({parameter_count(model) / 1e6:.1f} M parameters), "
        "SGD, global batch 256, synthetic data, 1 thread per process",
        "model_size": model,
        "workers": nproc,
        "repetitions": repetitions,
        "steps_per_repetition": steps,
        "samples_per_s": runs,
        "median_samples_per_s": med,
        "paired": {
            "loom_over_ddp": _paired(runs["loom"], runs["ddp"]),
            "loom_unobserved_over_ddp": _paired(runs["loom_unobserved"], runs["ddp"]),
            "loom_over_loom_unobserved": _paired(runs["loom"], runs["loom_unobserved"]),
        },
        "medians_ratio": {
            "loom_over_ddp": med["loom"] / med["ddp"],
            "loom_unobserved_over_ddp": med["loom_unobserved"] / med["ddp"],
        },  # fmt: skip
    }
    if samples.get("phases"):
        summary["phases_s"] = samples["phases"]
    if "one_process" in runs:
        summary["scaling_efficiency_paired"] = {
            name: _paired(runs[name], [nproc * v for v in runs["one_process"]])
            for name in ("loom", "loom_unobserved", "ddp")
        }
    return summary


def _phase_lines(phases: dict | None) -> list[str]:
    """Where rank 0's step goes, loom against DDP: medians over every timed step, in ms."""
    if not phases or "loom" not in phases or "ddp" not in phases:
        return []
    loom, ddp = ({k: 1e3 * v for k, v in phases[kind].items()} for kind in ("loom", "ddp"))
    outside = loom["outside_s"]
    ddp_total = sum(ddp.values())
    return [
        "Rank 0's step by phase (ms, median over every timed step; loom's from its step records, DDP's from laps "
        "around its forward, backward and optimizer step: DDP's all-reduce overlaps backward and its un-overlapped "
        "tail is in backward, loom's is in comm):",
        "",
        "| phase | loom (defaults) | raw DDP |",
        "|---|---:|---:|",
        f"| data (next batch, to the device) | {loom['data_s']:.2f} | (in forward) |",
        f"| forward + backward | {loom['compute_s']:.2f} | {ddp['forward_s'] + ddp['backward_with_allreduce_s']:.2f} |",
        f"| exchange, blocked | {loom['comm_s']:.2f} | (in backward) |",
        f"| optimizer | {loom['optimizer_s']:.2f} | {ddp['optimizer_s']:.2f} |",
        f"| outside the record (time between train_step returns - the record's time) | {outside:.2f} | |",
        f"| step | {loom['wall_s']:.2f} | {ddp_total:.2f} |",
        "",
    ]


def markdown(r: dict) -> str:
    med, paired, host = r["median_samples_per_s"], r["paired"], r["host"]
    eff = r.get("scaling_efficiency_paired", {})
    load = lambda v: "unknown" if v is None else " / ".join(f"{x:.2f}" for x in v)  # noqa: E731
    oversubscribed = r["workers"] > (host["cores"] or 0)

    def row(label: str, name: str, ratio: str) -> str:
        effect = f"{eff[name]:.2f}" if name in eff else ""
        return f"| {label} | {med[name]:.0f} | {ratio} | {effect} |"

    lines = [
        f"# loom DataParallel vs raw DDP: {r['model_size']} model, {r['workers']} workers",
        "",
        f"Command: `{r['command']}` ({r['date']}). Host: {host['machine']}, {host['cores']} cores, torch "
        f"{host['torch']}, Python {host['python']}. Load average (1/5/15 min) before {load(r.get('load_before'))}, "
        f"after {load(r.get('load_after'))}."
        + (
            f" **{r['workers']} processes on {host['cores']} cores: oversubscribed.**"
            if oversubscribed
            else ""
        ),
        "",
        f"Model: {r['model']}. {r['workers']} workers on one host (gloo), {r['repetitions']} repetitions of "
        f"{r['steps_per_repetition']} steps; within each repetition every configuration is timed in turn (the "
        "order rotates), the one-process baseline by rank 0 alone while the others wait.",
        "",
        "| | samples/s (median) | vs raw DDP (paired median) | scaling efficiency (paired median) |",
        "|---|---:|---:|---:|",
        row("loom DataParallel (defaults)", "loom", f"{paired['loom_over_ddp']:.3f}"),
        row(
            "loom DataParallel, `observe=False`",
            "loom_unobserved",
            f"{paired['loom_unobserved_over_ddp']:.3f}",
        ),
        row("raw DDP", "ddp", "1.000"),
    ]
    if "one_process" in med:
        lines.append(f"| one process | {med['one_process']:.0f} | | 1.00 (baseline) |")
    cost = 1 - paired["loom_over_loom_unobserved"]
    lines += [
        "",
        f"Observing (step records, phases, stragglers, memory samples) costs **{100 * cost:+.2f} %** of throughput "
        f"(paired median of 1 - loom / `observe=False`).",
        "",
        *_phase_lines(r.get("phases_s")),
        "Per repetition (samples/s): "
        + "; ".join(f"{k}: {', '.join(f'{v:.0f}' for v in vals)}" for k, vals in r["samples_per_s"].items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
