"""``loom demo``: the digits CNN on N local workers with DataParallel, then the same training as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loom.demo.other_load import OtherLoad, caveat

__all__ = ["run_demo"]


def run_demo(nproc: int, epochs: int, run_dir: Path) -> int:
    console = Console()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    train = ["-m", "loom.demo.train", "--epochs", str(epochs), "--summary"]
    launch = ["-m", "loom.cli", "run", "-n", str(nproc), "--run-dir", str(run_dir / "distributed")]
    single_env = dict(env, LOOM_RUN_DIR=str(run_dir / "single"))
    halves = {  # the half's folder in run_dir: its title, its launcher's arguments, environment and name in errors
        "distributed": (f"loom demo: DataParallel on {nproc} local workers", launch, env, "distributed"),
        "single": ("the same training as one process, for comparison", [], single_env, "one-process"),
    }
    wall: dict[str, float] = {}
    share: dict[str, float | None] = {}
    for half, (title, launcher, half_env, which) in halves.items():
        console.rule(f"[bold]{title}")
        started = time.perf_counter()
        with OtherLoad() as load:
            status = subprocess.call(
                [sys.executable, *launcher, *train, str(run_dir / half / "summary.json")], env=half_env
            )
        if status != 0:
            console.print(f"[red]the {which} run failed (exit status {status})")
            return status
        wall[half], share[half] = time.perf_counter() - started, load.share
    d, s = (json.loads((run_dir / half / "summary.json").read_text()) for half in halves)
    table = Table(title="loom demo summary (one thread per process)")
    table.add_column("")
    table.add_column(f"{nproc} workers", justify="right")
    table.add_column("1 process", justify="right")
    table.add_row("test accuracy", f"{100 * d['test_accuracy']:.2f}%", f"{100 * s['test_accuracy']:.2f}%")
    table.add_row("final train loss", f"{d['train_loss']:.4f}", f"{s['train_loss']:.4f}")
    table.add_row("training samples/s", f"{d['samples_per_s']:.0f}", f"{s['samples_per_s']:.0f}")
    table.add_row("wall time incl. start-up", f"{wall['distributed']:.1f} s", f"{wall['single']:.1f} s")
    console.print(table)
    speedup = d["samples_per_s"] / s["samples_per_s"]
    console.print(
        f"speed-up {speedup:.2f}x on {nproc} workers (scaling efficiency {100 * speedup / nproc:.0f}%); "
        f"logs and per-rank metrics in {run_dir}"
    )
    note = caveat(share["distributed"], share["single"])
    if note:  # one line, whatever the terminal's width (rich wraps at 80 in a pipe)
        console.print(note, soft_wrap=True)
    console.print(f"an HTML report of both runs: loom report {run_dir}", soft_wrap=True)
    return 0
