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


def _run(cmd: list[str], env: dict[str, str]) -> int:
    return subprocess.call(cmd, env=env)


def run_demo(nproc: int, epochs: int, run_dir: Path) -> int:
    console = Console()
    loom_cmd = [sys.executable, "-m", "loom.cli"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    distributed = run_dir / "distributed" / "summary.json"
    single = run_dir / "single" / "summary.json"
    console.rule(f"[bold]loom demo: DataParallel on {nproc} local workers")
    started = time.perf_counter()
    with OtherLoad() as load_distributed:
        status = _run(
            [
                *loom_cmd,
                "run",
                "-n",
                str(nproc),
                "--run-dir",
                str(run_dir / "distributed"),
                "-m",
                "loom.demo.train",
                "--epochs",
                str(epochs),
                "--summary",
                str(distributed),
            ],
            env,
        )
    if status != 0:
        console.print(f"[red]the distributed run failed (exit status {status})")
        return status
    wall_distributed = time.perf_counter() - started
    console.rule("[bold]the same training as one process, for comparison")
    started = time.perf_counter()
    with OtherLoad() as load_single:
        status = _run(
            [sys.executable, "-m", "loom.demo.train", "--epochs", str(epochs), "--summary", str(single)],
            dict(env, LOOM_RUN_DIR=str(run_dir / "single")),
        )
    if status != 0:
        console.print(f"[red]the one-process run failed (exit status {status})")
        return status
    wall_single = time.perf_counter() - started
    d, s = json.loads(distributed.read_text()), json.loads(single.read_text())
    table = Table(title="loom demo summary (one thread per process)")
    table.add_column("")
    table.add_column(f"{nproc} workers", justify="right")
    table.add_column("1 process", justify="right")
    table.add_row("test accuracy", f"{100 * d['test_accuracy']:.2f}%", f"{100 * s['test_accuracy']:.2f}%")
    table.add_row("final train loss", f"{d['train_loss']:.4f}", f"{s['train_loss']:.4f}")
    table.add_row("training samples/s", f"{d['samples_per_s']:.0f}", f"{s['samples_per_s']:.0f}")
    table.add_row("wall time incl. start-up", f"{wall_distributed:.1f} s", f"{wall_single:.1f} s")
    console.print(table)
    speedup = d["samples_per_s"] / s["samples_per_s"]
    console.print(
        f"speed-up {speedup:.2f}x on {nproc} workers (scaling efficiency {100 * speedup / nproc:.0f}%); "
        f"logs and per-rank metrics in {run_dir}"
    )
    note = caveat(load_distributed.share, load_single.share)
    if note:
        console.print(
            note, soft_wrap=True
        )  # one line, whatever the terminal's width (rich wraps at 80 in a pipe)
    console.print(f"an HTML report of both runs: loom report {run_dir}", soft_wrap=True)
    return 0
