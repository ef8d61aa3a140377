"""``python -m loom_bench.model_parallel``: loom's model parallelism vs PyTorch's own, and small messages.

Three parts, each one ``loom run`` job whose paths alternate round by round (same processes, same minutes):

1. micro-benchmark (2 processes): a 4 KiB all-reduce and a 4 KiB message there and back, through gloo and
   through loom's paths (`loom_bench.model_parallel_micro`);
2. pipeline: ``loom.Pipeline`` vs ``torch.distributed.pipelining`` (GPipe and 1F1B, an MLP chain and a small
   transformer; by default 2 stages and 4 micro-batches, ``--full``: 2 and 4 stages, 4 and 8 micro-batches);
3. tensor parallel: ``loom.TensorParallel`` vs DTensor's ``parallelize_module`` (two Megatron MLP blocks, an
   attention block; 2 processes, ``--full`` adds 4).

Each configuration reports the medians over rounds of seconds per step, loom / PyTorch as the ratio of medians
and as the median of each round's own ratio (paired), loom with its messages through gloo (the path before
shared memory) and the one-process time. The machine is shared: the load average (``os.getloadavg``) is recorded
before and after every part. Writes ``model_parallel.md`` and ``model_parallel.json`` into ``--out``.
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

__all__ = ["main", "markdown"]

REPORTS = Path(__file__).resolve().parents[2] / "benchmarks" / "reports"


def _launch(module: str, nproc: int, args: list[str], tmp: Path) -> dict:
    out = tmp / f"{module}-{nproc}.json"
    cmd = [sys.executable, "-m", "loom.cli", "run", "-n", str(nproc), "--run-dir", str(tmp / f"run-{nproc}")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load = os.getloadavg()[0]
    subprocess.run([*cmd, "-m", f"loom_bench.{module}", *args, "--out", str(out)], env=env, check=True)
    result = json.loads(out.read_text())
    result["load"] = [load, os.getloadavg()[0]]
    return result


def _pipeline_configs(stages: int, full: bool) -> list[str]:
    micro = (4, 8) if full else (4,)
    return [
        f"pp:{model}:{schedule}:{m}"
        for model in ("mlp", "transformer")
        for schedule in ("gpipe", "1f1b")
        for m in micro
        if m >= stages
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--full", action="store_true", help="4 stages, 8 micro-batches, 4-way tensor parallel"
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians over them)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per path and round")
    parser.add_argument("--parts", nargs="+", default=["micro", "pipeline", "tensor"])
    parser.add_argument("--out", type=Path, default=REPORTS)
    parser.add_argument("--render", type=Path, default=None, help="only rewrite the markdown from this JSON")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the other parts of the report in --out (each part keeps its own date and command)",
    )
    args = parser.parse_args()
    if args.render is not None:
        (args.out / "model_parallel.md").write_text(markdown(json.loads(args.render.read_text())))
        return
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": " ".join(["python -m loom_bench.model_parallel", *sys.argv[1:]]),
        "rounds": args.rounds,
        "steps": args.steps,
        "parts": {},
    }
    common = ["--rounds", str(args.rounds), "--steps", str(args.steps)]
    with tempfile.TemporaryDirectory(prefix="loom-bench-mp-") as name:
        tmp = Path(name)
        if "micro" in args.parts:
            report["parts"]["micro"] = _launch(
                "model_parallel_micro", 2, ["--rounds", str(max(args.rounds, 5))], tmp
            )
        for stages in (2, 4) if args.full else (2,):
            if "pipeline" in args.parts:
                configs = _pipeline_configs(stages, args.full)
                part = _launch("model_parallel_worker", stages, ["--configs", *configs, *common], tmp)
                report["parts"][f"pipeline-{stages}"] = part
            if "tensor" in args.parts:
                part = _launch(
                    "model_parallel_worker", stages, ["--configs", "tp:mlp", "tp:attention", *common], tmp
                )
                report["parts"][f"tensor-{stages}"] = part
    for part in report["parts"].values():
        part["date"], part["command"] = report["date"], report["command"]
    previous = args.out / "model_parallel.json"
    if args.keep and previous.exists():
        kept = json.loads(previous.read_text())
        for part in kept["parts"].values():
            part.setdefault("date", kept["date"])
            part.setdefault("command", kept["command"])
        kept["parts"].update(report["parts"])
        report = kept
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_parallel.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (args.out / "model_parallel.md").write_text(text)
    print(text)


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}"


def _row(world: int, result: dict) -> str:
    s = result["seconds"]
    loom, peer, before = s["loom"], s["torch"], s["loom_backend"]
    ratio, paired = _ratios(result)
    speedup = statistics.median(before) / statistics.median(loom)
    first = result["first_loss"]
    agree = abs(first["loom"] - first["torch"]) <= 1e-4 * max(1.0, abs(first["torch"]))
    verdict = "yes" if ratio <= 1.0 and paired <= 1.0 else "**no**"
    return (
        f"| {result['config']} | {world} | {_ms(loom)} | {_ms(peer)} | {ratio:.2f} | {paired:.2f} | {verdict} | "
        f"{_ms(before)} ({speedup:.2f}x) | {_ms(s['one_process'])} | {'yes' if agree else '**no**'} |"
    )


def _targets(parts: dict, tables: list) -> list[str]:
    """The issue's targets, each with the figure that decides it."""
    out = ["## Targets", ""]
    if "micro" in parts:
        us = {k: statistics.median(v) for k, v in parts["micro"]["us"].items()}
        small, pair = us["all_reduce loom shm_small (1 barrier)"], us["send/recv loom pipeline over shm"] / 2
        best = min(parts["micro"]["us"]["all_reduce loom shm_small (1 barrier)"])
        out.append(
            f"- 4 KiB all-reduce ≤ 20 µs median: {small:.0f} µs ({'met' if small <= 20 else '**not met**'}; "
            f"fastest round {best:.0f} µs). 4 KiB send/recv ≤ 20 µs: {pair:.0f} µs per message "
            f"({'met' if pair <= 20 else '**not met**'})."
        )
    for kind, label, peer in (("pipeline", "loom.Pipeline", "torch.distributed.pipelining"),
                              ("tensor", "loom.TensorParallel", "DTensor")):  # fmt: skip
        rows = [r for k, part in tables if k.startswith(kind) for r in part["results"]]
        if not rows:
            continue
        ok = [r for r in rows if _ratios(r)[0] <= 1.0 and _ratios(r)[1] <= 1.0]
        worst = max(rows, key=lambda r: _ratios(r)[0])
        out.append(
            f"- {label} at or below {peer}: {len(ok)} of {len(rows)} configurations by both ratios "
            f"(worst: {worst['config']} at {_ratios(worst)[0]:.2f} of the medians, {_ratios(worst)[1]:.2f} paired)."
        )
    return [*out, ""]


def _ratios(result: dict) -> tuple[float, float]:
    s = result["seconds"]
    paired = statistics.median(a / b for a, b in zip(s["loom"], s["torch"], strict=True))
    return statistics.median(s["loom"]) / statistics.median(s["torch"]), paired


def markdown(report: dict) -> str:
    parts = report["parts"]
    lines = [
        "# Model parallelism: loom vs PyTorch's own, and small messages on one host",
        "",
        f"Command: `{report['command']}` ({report['date']}; {report['machine']}; gloo on loopback, "
        "1 thread per process). The machine's 2 cores are shared with other jobs; the 1-minute load average "
        "before and after each part is given with it.",
        "",
    ]
    if "micro" in parts:
        micro = parts["micro"]
        lines += [
            f"## Small messages: {micro['bytes']} bytes between 2 processes, median latency",
            "",
            f"{micro['calls']} calls per path and round, each timed alone; a round's figure is the slower rank's "
            "median; the table gives the median over rounds. A send/recv pair is one message each way (a "
            "ping-pong round trip): one message takes half of it. Load average "
            f"{micro['load'][0]:.1f} → {micro['load'][1]:.1f}."
            + (
                f" This part: `{micro['command']}` ({micro['date']})."
                if micro.get("command", report["command"]) != report["command"]
                else ""
            ),
            "",
            "| path | median µs | per round µs |",
            "|---|---:|---|",
        ]
        for path, values in micro["us"].items():
            lines.append(
                f"| {path} | {statistics.median(values):.1f} | {', '.join(f'{v:.0f}' for v in values)} |"
            )
        lines.append("")
    tables = [(k, v) for k, v in parts.items() if k != "micro"]
    lines += _targets(parts, tables)
    if tables:
        lines += [
            "## Training steps: loom vs PyTorch (ms per step, medians)",
            "",
            f"{report['rounds']} rounds of {report['steps']} steps per path, alternating in one job. *loom/torch* "
            "is the ratio of the medians, *paired* the median of each round's own ratio; *at or below* says "
            "whether both are ≤ 1. *loom over gloo* is loom with its messages through the backend (the path "
            "before shared memory; in brackets how much faster the shared-memory path is). *first loss "
            "agrees*: both started from the same weights on the same batch and their first losses agree.",
            "",
            "| configuration | processes | loom | torch | loom/torch | paired | at or below | loom over gloo | "
            "one process | first loss agrees |",
            "|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
        ]
        for _, part in tables:
            for result in part["results"]:
                lines.append(_row(part["world_size"], result))
        lines += [
            "",
            "Peers: `pp:*` is `torch.distributed.pipelining` (`PipelineStage`, `ScheduleGPipe` / `Schedule1F1B`) on "
            "the same layers cut the same way; `tp:*` is DTensor's `parallelize_module` with `ColwiseParallel` / "
            "`RowwiseParallel` on the same linears. Load averages: "
            + "; ".join(f"{k} {v['load'][0]:.1f} → {v['load'][1]:.1f}" for k, v in tables)
            + ".",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
