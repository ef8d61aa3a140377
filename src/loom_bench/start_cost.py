"""``python -m loom_bench.start_cost``: what `loom run` costs to start its workers, zygote on vs off.

Baseline: ``LOOM_ZYGOTE=0``, every worker a fresh interpreter that imports torch and loom itself (what `loom run`
did before `loom.launch.zygote`, and what ``torchrun`` does). Measured: the same `loom run -n N` of a tiny
DataParallel job (5 steps of a 32-32 MLP) with the zygote on, the two alternated in one sitting, ``--reps``
times each, for the default policy (PyTorch's elastic agent, ``restart``) and ``--on-worker-failure heal``. Per run:
the wall time from the command's start to the last worker's first finished step, the whole command's wall time,
and the CPU time of the command and everything it started (``RUSAGE_CHILDREN``). The report gives the medians and
the median of the paired ratios (on / off, each pair run back to back), with the load averages.

Writes ``start_cost.md`` and ``.json`` into ``--report-dir`` (default benchmarks/reports).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from torch import nn
    import loom
    loom.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    job = loom.DataParallel().setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
    data = torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
    for step, batch in enumerate(job.loader(data, global_batch_size=32, seed=0)):
        job.train_step(batch)
        if step == 0:
            with open(os.path.join(sys.argv[1], f"first.{os.environ['RANK']}"), "w") as out:
                out.write(repr(time.time()))
        if step == 4:
            break
    """
)


def one_run(nproc: int, policy: str, zygote: bool, workdir: Path) -> dict[str, float]:
    marks = Path(tempfile.mkdtemp(dir=workdir))
    script = workdir / "start_cost_job.py"
    policy_args = [] if policy == "restart" else ["--on-worker-failure", policy]
    cmd = [sys.executable, "-m", "loom.cli", "run", "-n", str(nproc), *policy_args, "--run-dir", str(marks / "run"),
           str(script), str(marks)]  # fmt: skip
    env = dict(os.environ, LOOM_ZYGOTE="1" if zygote else "0")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"start_cost: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    firsts = [float((marks / f"first.{r}").read_text()) for r in range(nproc)]
    return {
        "first_step_s": max(firsts) - started,
        "wall_s": ended - started,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--nproc", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--policy", action="append", choices=["restart", "heal"], help="default: both")
    parser.add_argument("--report-dir", type=Path, default=Path("benchmarks/reports"))
    args = parser.parse_args(argv)
    policies = args.policy or ["restart", "heal"]
    loads = [os.getloadavg()[0]]
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="loom-start-cost-") as tmp:
        workdir = Path(tmp)
        (workdir / "start_cost_job.py").write_text(SCRIPT)
        for policy in policies:
            runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
            for rep in range(args.reps):
                for side in ("off", "on") if rep % 2 == 0 else ("on", "off"):  # alternate who goes first
                    runs[side].append(one_run(args.nproc, policy, side == "on", workdir))
                    print(f"{policy} rep {rep + 1}/{args.reps} zygote {side}: {runs[side][-1]}", flush=True)
                loads.append(os.getloadavg()[0])
            results[policy] = runs
    summary = {}
    for policy, runs in results.items():
        summary[policy] = {
            key: {
                "off_median": statistics.median(r[key] for r in runs["off"]),
                "on_median": statistics.median(r[key] for r in runs["on"]),
                "paired_ratio_median": statistics.median(
                    on[key] / off[key] for on, off in zip(runs["on"], runs["off"], strict=True)
                ),
            }  # fmt: skip
            for key in ("first_step_s", "wall_s", "cpu_s")
        }
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python -m loom_bench.start_cost " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# `loom run`'s start: workers forked from the zygote vs fresh interpreters",
        "",
        f"Command: `{command.strip()}` ({stamp}; {platform.machine()}, {os.cpu_count()} CPUs; load averages over "
        f"the run {min(loads):.2f}-{max(loads):.2f}).",
        "",
        f"Job: `loom run -n {args.nproc}` of 5 DataParallel steps of a 32-32-1 MLP (gloo, CPU). Baseline: "
        "`LOOM_ZYGOTE=0` (every worker a fresh interpreter). Alternated pairs, "
        f"{args.reps} of each; medians, and the median of the per-pair ratios zygote on / off.",
        "",
        "| policy | figure | zygote off (median) | zygote on (median) | on / off (paired median) |",
        "|---|---|---|---|---|",
    ]
    names = {"first_step_s": "start -> every worker's first step (s)", "wall_s": "whole command (s)",
             "cpu_s": "CPU of the command and its processes (s)"}  # fmt: skip
    for policy, figures in summary.items():
        for key, f in figures.items():
            lines.append(f"| {policy} | {names[key]} | {f['off_median']:.2f} | {f['on_median']:.2f} | "
                         f"{f['paired_ratio_median']:.2f} |")  # fmt: skip
    args.report_dir.mkdir(parents=True, exist_ok=True)
    (args.report_dir / "start_cost.md").write_text("\n".join(lines) + "\n")
    (args.report_dir / "start_cost.json").write_text(
        json.dumps(
            {"command": command, "when": stamp, "loads": loads, "runs": results, "summary": summary}, indent=1
        )
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
