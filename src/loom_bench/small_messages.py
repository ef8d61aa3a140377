"""``python -m loom_bench.small_messages OLD NEW``: small shared-memory messages under two commits, alternating.

Each commit is checked out (``git worktree add --detach``) into a temporary folder whose ``src/loom_bench`` is
replaced by THIS checkout's, so both commits are timed by the same benchmark code. Then, for ``--rounds``
rounds, in an order that alternates from round to round, each commit runs on 2 processes:

0. the CPU time of one 4 KiB message's Python work at both ends, in one process (`loom_bench.small_message_cpu`:
   thread CPU time, which the machine's load inflates far less than it does latencies);
1. the micro-benchmark's pipeline message paths (`loom_bench.model_parallel_micro` ``--paths "pipeline over
   shm"``: a 4 KiB message there and back through `loom.comm.shm_channel`, the round trip's median);
2. the pipeline step benchmark (`loom_bench.model_parallel_worker`) on ``--configs`` (default: the MLP chain
   with GPipe and the transformer with 1F1B, 4 micro-batches), one round of ``--steps`` steps each, loom and
   ``torch.distributed.pipelining`` in the same processes (loom / torch cancels the minute's load).

The report gives every round's figures, their medians and the paired ratios NEW / OLD, with the load average.
Writes ``small_messages.md`` and ``small_messages.json`` into ``--out`` (default ``benchmarks/reports``).
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

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
MICRO = "send/recv loom pipeline over shm"


def _checkout(commit: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(into), commit], check=True,
                   capture_output=True)  # fmt: skip
    shutil.rmtree(into / "src" / "loom_bench")
    shutil.copytree(BENCH, into / "src" / "loom_bench", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def _resolve(commit: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", commit], check=True, capture_output=True
    )
    return out.stdout.decode().strip()


def _job(tree: Path, module: str, args: list[str], scratch: Path) -> dict:
    out = scratch / f"{tree.name}-{time.monotonic_ns()}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree / "src"))
    cmd = [sys.executable, "-m", "loom.cli", "run", "-n", "2", "--run-dir", str(scratch / "run"), "-m",
           f"loom_bench.{module}", *args, "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=tree)
    return json.loads(out.read_text())


def _cpu(tree: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, "-m", "loom_bench.small_message_cpu"], env=env, check=True, cwd=tree,
                         capture_output=True)  # fmt: skip
    return float(json.loads(out.stdout.decode().strip().splitlines()[-1])["us"])


def _one_round(tree: Path, configs: list[str], steps: int, calls: int, scratch: Path) -> dict:
    micro = _job(tree, "model_parallel_micro", ["--paths", "pipeline over shm", "--rounds", "1", "--calls",
                                                 str(calls)], scratch)  # fmt: skip
    steps_out = _job(tree, "model_parallel_worker", ["--configs", *configs, "--rounds", "1", "--steps", str(steps)],
                     scratch)  # fmt: skip
    return {
        "cpu_us": _cpu(tree),
        "micro_us": {k: v[0] for k, v in micro["us"].items()},
        "steps": {r["config"]: {k: v[0] for k, v in r["seconds"].items()} for r in steps_out["results"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400, help="timed ping-pongs per path and round")
    parser.add_argument("--configs", nargs="+", default=["pp:mlp:gpipe:4", "pp:transformer:1f1b:4"])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/reports")
    ns = parser.parse_args(argv)
    commits = {"old": _resolve(ns.old), "new": _resolve(ns.new)}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="loom-small-") as tmp:
        trees = {name: _checkout(commit, Path(tmp) / name) for name, commit in commits.items()}
        try:
            for r in range(ns.rounds):
                order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
                result: dict = {"load": os.getloadavg()[0]}
                for name in order:
                    result[name] = _one_round(trees[name], ns.configs, ns.steps, ns.calls, Path(tmp))
                rounds.append(result)
                print(f"round {r + 1} (load {result['load']:.1f}): " + ", ".join(
                    f"{n} {result[n]['micro_us'][MICRO]:.0f} us" for n in order), flush=True)  # fmt: skip
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)  # fmt: skip
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(
            ["python -m loom_bench.small_messages", *(argv if argv is not None else sys.argv[1:])]
        ),
        "cores": os.cpu_count(),
        "commits": commits,
        "rounds": rounds,
    }
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "small_messages.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (ns.out / "small_messages.md").write_text(text)
    print(text)
    return 0


def _cells(values: list[float], scale: float, fmt: str) -> str:
    return (
        f"**{statistics.median(values) * scale:{fmt}}** ({', '.join(f'{v * scale:{fmt}}' for v in values)})"
    )


def markdown(report: dict) -> str:
    rounds, (old, new) = report["rounds"], (report["commits"]["old"], report["commits"]["new"])
    loads = ", ".join(f"{r['load']:.1f}" for r in rounds)
    lines = [
        f"# Small shared-memory messages: {new} vs {old}",
        "",
        f"Command: `{report['command']}` ({report['date']}, {report['cores']} cores shared with other jobs; "
        f"load average at each round's start: {loads}). Both commits run "
        "the same benchmark code, 2 processes, alternating round by round; medians in bold, then every round.",
        "",
        "| figure | old | new | new / old, paired (median) |",
        "|---|---|---|---:|",
    ]
    if "cpu_us" in rounds[0]["old"]:
        o, n = ([r[k]["cpu_us"] for r in rounds] for k in ("old", "new"))
        paired = statistics.median(b / a for a, b in zip(o, n, strict=True))
        lines.append(
            f"| one 4 KiB message, both ends in one process: CPU µs (`loom_bench.small_message_cpu`) | "
            f"{_cells(o, 1, '.1f')} | {_cells(n, 1, '.1f')} | {paired:.2f} |"
        )
    for path in rounds[0]["old"]["micro_us"]:
        o, n = ([r[k]["micro_us"][path] for r in rounds] for k in ("old", "new"))
        paired = statistics.median(b / a for a, b in zip(o, n, strict=True))
        lines.append(
            f"| {path}: µs per round trip | {_cells(o, 1, '.0f')} | {_cells(n, 1, '.0f')} | {paired:.2f} |"
        )
    for config in rounds[0]["old"]["steps"]:
        for key, label in (("loom", "loom ms/step"), ("torch", "torch.distributed.pipelining ms/step")):
            o, n = ([r[k]["steps"][config][key] for r in rounds] for k in ("old", "new"))
            paired = statistics.median(b / a for a, b in zip(o, n, strict=True))
            lines.append(
                f"| {config}: {label} | {_cells(o, 1e3, '.1f')} | {_cells(n, 1e3, '.1f')} | {paired:.2f} |"
            )
        o, n = (
            [r[k]["steps"][config]["loom"] / r[k]["steps"][config]["torch"] for r in rounds]
            for k in ("old", "new")
        )
        paired = statistics.median(b / a for a, b in zip(o, n, strict=True))
        lines.append(
            f"| {config}: loom / torch | {_cells(o, 1, '.2f')} | {_cells(n, 1, '.2f')} | {paired:.2f} |"
        )
    micro_new = statistics.median(r["new"]["micro_us"][MICRO] for r in rounds) / 2
    lines += [
        "",
        f"One 4 KiB message (half a round trip) at {new}: {micro_new:.1f} µs median "
        f"({'within' if micro_new <= 20 else '**above**'} the 20 µs target).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
