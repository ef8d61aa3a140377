"""``python -m loom_bench.plan_accuracy``: `loom plan`'s predictions against measured runs, one host.

For each model size (the MLP chain of ``tests/workers/plan_tiny.py`` at a width and depth), `loom.plan.plan`
plans 2 processes; then every configuration of `CHOSEN` that the plan predicted runs a few steps under
``loom run`` (`loom.plan.planner.verify` on that one configuration), and its predicted and measured step time
and persistent state (parameters, gradients, optimizer state, the largest rank) are written side by side, with
the load average before and after each run. Writes ``plan_accuracy.md`` and ``plan_accuracy.json`` into
``--out`` after every model (a run stopped early keeps what it measured).

    PYTHONPATH=src python -m loom_bench.plan_accuracy [--out benchmarks/reports] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from loom.plan.planner import PlanResult, plan, verify
from loom.plan.recommend import Ranked

__all__ = ["CHOSEN", "MODELS", "main"]

MODELS = {"small": ("--width", "64", "--depth", "4"), "medium": ("--width", "512", "--depth", "6"),
          "large": ("--width", "1536", "--depth", "6")}  # fmt: skip
CHOSEN = (
    'loom.DataParallel(allreduce="native")', 'loom.DataParallel(allreduce="ring")',
    'loom.DataParallel(allreduce="shm")', 'loom.DataParallel(compression="fp16")',
    'loom.DataParallel(compression="powersgd:4")', "loom.ShardedDataParallel(stage=1)",
    "loom.ShardedDataParallel(stage=3)", 'loom.ParameterServer(mode="sync")', "loom.LocalSGD(sync_every=8)",
    "loom.DiLoCo(sync_every=8)", 'loom.Pipeline(stages=2, microbatches=2, schedule="gpipe")',
    'loom.Pipeline(stages=2, microbatches=4, schedule="1f1b")',
)  # fmt: skip
SCRIPT = str(Path(__file__).resolve().parents[2] / "tests" / "workers" / "plan_tiny.py")


def _load() -> float:
    return os.getloadavg()[0]


def _rows(result: PlanResult, args: tuple[str, ...], steps: int) -> list[dict[str, Any]]:
    picked: list[Ranked] = []
    for strategy in CHOSEN:
        ranked = [r for r in result.ranked if r.prediction.config.strategy == strategy and r.feasible]
        picked += [r for r in ranked if r.prediction.config.servers in (0, 1)][:1]
    rows: list[dict[str, Any]] = []
    for r in picked:
        before = _load()
        one = PlanResult(**{**result.__dict__, "ranked": [r], "verifications": []})
        try:
            v = verify(one, args, top=1, steps=steps)[0]
        except Exception as error:  # noqa: BLE001 - a failed run is a row of the report, not the end of it
            rows.append({"strategy": r.prediction.config.strategy, "launch": r.prediction.config.launch,
                         "error": str(error)[:300]})  # fmt: skip
            continue
        rows.append({
            "strategy": v.config.strategy, "launch": v.config.launch, "predicted_s": v.predicted_s,
            "measured_s": v.measured_s, "step_error": v.error, "predicted_state": v.predicted_state,
            "measured_state": v.measured_state, "load_before": before, "load_after": _load(),
            "rank_predicted": result.ranked.index(r) + 1,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _markdown(report: dict) -> str:
    lines = [
        "# `loom plan`: predicted vs measured, one host, 2 processes",
        "",
        f"Command: `{report['command']}` ({report['date']}, {report['machine']}). Model: the MLP chain of "
        "`tests/workers/plan_tiny.py` (Adam, global batch 64), at three sizes. Step time: the median of "
        f"{report['steps']} steps (each the slowest rank's) after 2 warm-up steps, under `loom run -n 2`. State: "
        "parameters + gradients + optimizer state of the largest rank, counted by `job.memory()`. Error: "
        "predicted / measured - 1.",
        "",
    ]
    for name, model in report["models"].items():
        errs = [abs(r["step_error"]) for r in model["rows"] if "step_error" in r]
        lines += [f"## {name} ({model['params']:,} parameters, {model['args']})", "",
                  f"Plan: {model['plan_seconds']}; measured engine overhead per step {model['overhead_s'] * 1e3:.1f} ms,"
                  f" overlap coefficient {model['overlap']:.2f}. Step-time |error|: median "
                  f"{statistics.median(errs):.0%}, mean {statistics.mean(errs):.0%}, worst {max(errs):.0%} "
                  f"({len(errs)} configurations)." if errs else "", "",
                  "| configuration | loom run | predicted ms | measured ms | error | state predicted | state measured "
                  "| load before/after |", "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in model["rows"]:
            if "error" in r:
                lines.append(f"| `{r['strategy']}` | {r['launch']} | | | failed: {r['error']} | | | |")
                continue
            lines.append(
                f"| `{r['strategy']}` | {r['launch']} | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} "
                f"| {r['step_error']:+.0%} | {r['predicted_state']:,} | {r['measured_state']:,} "
                f"| {r['load_before']:.1f} / {r['load_after']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loom_bench.plan_accuracy")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    ns = parser.parse_args(argv)
    report: dict = {"command": "PYTHONPATH=src python -m loom_bench.plan_accuracy " + " ".join(argv or []),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": ns.steps,
                    "machine": f"{os.cpu_count()} cores", "models": {}}  # fmt: skip
    for name in ns.models.split(","):
        args = MODELS[name]
        result = plan(SCRIPT, args, nproc=2)
        seconds = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
        print(f"{name}: planned ({seconds})", flush=True)
        report["models"][name] = {
            "args": " ".join(args), "params": result.profile.param_count, "plan_seconds": seconds,
            "overhead_s": result.overhead_s, "overlap": result.transport.overlap,
            "rows": _rows(result, args, ns.steps),
        }  # fmt: skip
        ns.out.mkdir(parents=True, exist_ok=True)
        (ns.out / "plan_accuracy.json").write_text(json.dumps(report, indent=1))
        (ns.out / "plan_accuracy.md").write_text(_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
