"""``python -m loom_bench.compare_commits OLD NEW [--strategy S]``: a benchmark worker under two commits, alternating.

Each commit is checked out (``git worktree add --detach``) into a temporary folder; then, for ``--rounds``
rounds, a benchmark worker (run from THIS checkout so both commits are timed by the same code) runs on 2
processes with each commit's ``src`` first on ``PYTHONPATH``, the order alternating from round to round: for
``--strategy dp`` (the default) DataParallel's (`loom_bench.dp_worker`), for ``localsgd``, ``diloco``,
``gossip``, ``ps-sync`` and ``ps-async`` `loom_bench.strategy_worker` (the parameter-server cases with
``--servers 2``). Raw DDP is timed in the same processes as loom, so ``loom / DDP`` cancels the machine's load;
the report gives each commit's median ratio and the paired ratio (NEW / OLD) of every round. Writes
``compare_<old>_<new>[_<strategy>].md`` into ``--out`` (default ``benchmarks/reports``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loom_bench.strategy_worker import STRATEGIES

REPO = Path(__file__).resolve().parents[2]
BENCH_SRC = Path(__file__).resolve().parents[1]
TITLE = {"dp": "DataParallel", "localsgd": "LocalSGD(sync_every=8)", "diloco": "DiLoCo(sync_every=8)",
         "gossip": "Gossip(ring, every=1)", "ps-sync": "ParameterServer(sync, 2 servers)",
         "ps-async": "ParameterServer(async, 2 servers)"}  # fmt: skip


def _checkout(commit: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(into), commit], check=True,
                   capture_output=True)  # fmt: skip
    return into


def _resolve(commit: str) -> str:
    """The short hash of ``commit`` (a branch or ``HEAD`` would not say what was measured)."""
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", commit], check=True, capture_output=True
    )
    return out.stdout.decode().strip()


def _launcher(tree: Path) -> str:
    """The CLI module of that commit (``loom.cli``; ``loom.launch.cli`` before it moved)."""
    return "loom.cli" if (tree / "src/loom/cli.py").exists() else "loom.launch.cli"


def _one_run(tree: Path, strategy: str, repetitions: int, steps: int, scratch: Path) -> dict:
    out = scratch / f"{tree.name}-{time.monotonic_ns()}.json"
    if strategy == "dp":
        worker = ["loom_bench.dp_worker"]
    else:
        worker = ["loom_bench.strategy_worker", "--strategy", strategy]
    servers = ["--servers", "2"] if strategy.startswith("ps-") else []
    bench = scratch / "bench"  # this checkout's loom_bench alone, ahead of the commit's own copy of it
    if not bench.exists():
        shutil.copytree(
            BENCH_SRC / "loom_bench", bench / "loom_bench", ignore=shutil.ignore_patterns("__pycache__")
        )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{bench}{os.pathsep}{tree / 'src'}")
    cmd = [sys.executable, "-m", _launcher(tree), "run", "-n", "2", *servers, "--run-dir", str(scratch / "run"),
           "-m", *worker, "--repetitions", str(repetitions), "--steps", str(steps), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    samples = json.loads(out.read_text())
    return {"loom": statistics.median(samples["loom"]), "ddp": statistics.median(samples["ddp"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--strategy", default="dp", choices=("dp", *STRATEGIES),
                        help="dp: loom bench dp's worker; the others: loom_bench.strategy_worker")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/reports")
    ns = parser.parse_args(argv)
    ns.old, ns.new = (_resolve(c) for c in (ns.old, ns.new))
    with tempfile.TemporaryDirectory(prefix="loom-compare-") as tmp:
        trees = {
            name: _checkout(commit, Path(tmp) / name) for name, commit in (("old", ns.old), ("new", ns.new))
        }
        try:
            rounds: list[dict[str, dict]] = []
            for r in range(ns.rounds):
                order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
                result = {
                    name: _one_run(trees[name], ns.strategy, ns.repetitions, ns.steps, Path(tmp))
                    for name in order
                }
                result["load"] = {"1min": os.getloadavg()[0]}
                rounds.append(result)
                print(f"round {r + 1}: " + ", ".join(
                    f"{n} loom {result[n]['loom']:.0f} / ddp {result[n]['ddp']:.0f} samples/s" for n in order
                ), flush=True)  # fmt: skip
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)  # fmt: skip
    ratio = {n: [x[n]["loom"] / x[n]["ddp"] for x in rounds] for n in ("old", "new")}
    paired = [b / a for a, b in zip(ratio["old"], ratio["new"], strict=True)]
    lines = [
        f"# {TITLE.get(ns.strategy, ns.strategy)} at {ns.new} vs {ns.old} (loom / raw DDP in the same processes)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, 2 processes, MLP 784-1024-1024-10, global "
        f"batch 256, {ns.rounds} alternating rounds x {ns.repetitions} repetitions x {ns.steps} steps "
        f"(`python -m loom_bench.compare_commits {ns.old} {ns.new} --strategy {ns.strategy} --rounds {ns.rounds}"
        f" --repetitions {ns.repetitions} --steps {ns.steps}`).",
        "",
        "| round | load (1 min) | old loom/DDP | new loom/DDP | new / old |",
        "|---|---|---|---|---|",
        *(
            f"| {i + 1} | {x['load']['1min']:.1f} | {ratio['old'][i]:.3f} | {ratio['new'][i]:.3f} | {paired[i]:.3f} |"
            for i, x in enumerate(rounds)
        ),  # fmt: skip
        f"| **median** | | **{statistics.median(ratio['old']):.3f}** | **{statistics.median(ratio['new']):.3f}** | "
        f"**{statistics.median(paired):.3f}** |",
        "",
    ]
    ns.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if ns.strategy == "dp" else f"_{ns.strategy}"
    report = ns.out / f"compare_{ns.old[:7]}_{ns.new[:7]}{suffix}.md"
    report.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"written: {report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
