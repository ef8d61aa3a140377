"""``python -m loom_bench.sharded_capacity``: the largest model that trains on 4 processes with Adam, per strategy,
inside a memory limit.

The issue's target is "the largest model that trains on 4 processes of this 24 GiB machine with Adam at least
3.5x the largest that trains with DataParallel". Filling the whole machine would take it from everyone else on
it, so the 24 GiB are stood for by a memory cgroup: a child of this process's own memory cgroup (cgroup v1's
``memory`` controller or v2's unified tree), with ``limit_in_bytes``/``memory.max`` at ``--limit-gib`` and no swap,
holding ``loom run -n 4`` and everything it starts. A model fits when the job trains 2 Adam steps and exits 0;
it does not when the kernel's OOM killer ends a process of the cgroup (counted in the cgroup's OOM events, so
a failure for another reason stops the search instead of reading as "too big").

For each strategy the MLP's width is grown by 1.4x from a size that fits until one does not, then bisected to
``--resolution`` (parameters ~ 8 x width^2: `loom_bench.sharded_capacity_worker`). Every process in the cgroup
pays the same fixed cost (the interpreter and torch, a few hundred MB each), so the ratio of parameters is the
ratio of what is left for the training state and the step's transients (a run at another limit shows how much
that fixed part moves the ratio).

Writes ``sharded_capacity.md`` and ``.json`` into the report directory. Needs root (to create the cgroup).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loom_bench.sharded_capacity_worker import parameters

__all__ = ["MemoryCgroup", "largest_width", "main", "search_largest"]

STRATEGIES = ("dp", "stage3", "stage1", "stage2")
LABELS = {"dp": "DataParallel", "stage1": "ZeRO stage 1", "stage2": "ZeRO stage 2", "stage3": "ZeRO stage 3"}


class MemoryCgroup:
    """A child memory cgroup of this process's own, with a hard limit and no swap; removed by `close`."""

    def __init__(self, limit_bytes: int, name: str) -> None:
        self.v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        own = self._own_path()
        base = Path("/sys/fs/cgroup") if self.v2 else Path("/sys/fs/cgroup/memory")
        self.path = base / own.lstrip("/") / name
        try:
            self.path.mkdir()
        except OSError as error:
            raise RuntimeError(
                f"cannot create the memory cgroup {self.path} ({error}). HINT: run as root on Linux with the "
                "memory controller mounted (cgroup v1 at /sys/fs/cgroup/memory, or v2)"
            ) from error
        if self.v2:
            self._write("memory.max", str(limit_bytes))
            self._write("memory.swap.max", "0")
        else:
            self._write("memory.limit_in_bytes", str(limit_bytes))
            if (self.path / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swap at all
                self._write("memory.memsw.limit_in_bytes", str(limit_bytes))
        self.limit_bytes = limit_bytes

    def _own_path(self) -> str:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (self.v2 and controllers == "") or (not self.v2 and "memory" in controllers.split(",")):
                return path
        raise RuntimeError("this process is in no memory cgroup (/proc/self/cgroup)")

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def oom_kills(self) -> int:
        """OOM kills in this cgroup so far (v2 ``memory.events``; v1 ``memory.oom_control``'s ``oom_kill``, or
        ``memory.failcnt`` on kernels without it)."""
        if self.v2:
            text = (self.path / "memory.events").read_text()
        else:
            text = (self.path / "memory.oom_control").read_text()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return int((self.path / "memory.failcnt").read_text())

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        path = self.path / name
        return int(path.read_text()) if path.exists() else None

    def reset_peak(self) -> None:
        if not self.v2:
            self._write("memory.max_usage_in_bytes", "0")

    def procs(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def close(self) -> None:
        for pid in self.procs():  # only what this benchmark started is in there
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.procs() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.path.rmdir()


def trial(cgroup: MemoryCgroup, strategy: str, width: int, timeout_s: float, run_dir: Path) -> dict:
    """One 4-process job in the cgroup (its logs in ``run_dir``): ``{"fits": bool, "oom": bool, ...}``."""
    before = cgroup.oom_kills()
    cgroup.reset_peak()
    procs = cgroup.path / "cgroup.procs"
    worker = ["-m", "loom_bench.sharded_capacity_worker", "--strategy", strategy, "--width", str(width)]
    launch = [sys.executable, "-m", "loom.cli", "run", "-n", "4", "--run-dir", str(run_dir), *worker]
    # the shell joins the cgroup, then becomes the launcher: every process it starts is born inside
    command = ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *launch]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    started = time.monotonic()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    for pid in cgroup.procs():  # anything the launcher left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while cgroup.procs():
        time.sleep(0.2)
    oom = cgroup.oom_kills() > before
    lines = [json.loads(line[line.index('{"ok"') :]) for line in (out + err).splitlines() if '{"ok"' in line]
    result = {"strategy": strategy, "width": width, "params": parameters(width), "fits": proc.returncode == 0
              and bool(lines), "oom": oom, "seconds": round(time.monotonic() - started, 1),
              "cgroup_peak": cgroup.peak_bytes()}  # fmt: skip
    if lines:
        result.update(peak_rss=lines[0]["peak_rss"], state=lines[0]["state"])
    if not result["fits"] and not oom:
        raise RuntimeError(
            f"{strategy} at width {width} failed without running out of memory (exit {proc.returncode}):\n"
            f"{err[-3000:]}"
        )
    return result


def search_largest(fits: Callable[[int], bool], start: int, resolution: float) -> int:
    """The largest width that ``fits``: grow from ``start`` (which must fit) by 1.4x until one does not, then
    bisect until the gap is at most ``resolution`` of the width (or 16). Widths are multiples of 16."""
    if not fits(start):
        raise RuntimeError(f"the starting width {start} does not fit; start lower (--start-width)")
    low, high = start, None
    while high is None:
        candidate = max(int(low * 1.4) // 16 * 16, low + 16)
        if fits(candidate):
            low = candidate
        else:
            high = candidate
    while (high - low) > max(16, resolution * low):
        middle = (low + high) // 32 * 16
        if middle in (low, high):
            break
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def largest_width(cgroup: MemoryCgroup, strategy: str, start: int, resolution: float, timeout_s: float,
                  log: list[dict], run_dir: Path) -> int:  # fmt: skip
    """`search_largest` over real trials of ``strategy`` in ``cgroup``; every trial goes into ``log``."""

    def fits(width: int) -> bool:
        result = trial(cgroup, strategy, width, timeout_s, run_dir / f"{strategy}-{width}-{len(log)}")
        log.append(result)
        print(f"  {strategy} width {width} ({result['params'] / 1e6:.1f} M parameters): "
              f"{'fits' if result['fits'] else 'out of memory'} ({result['seconds']} s)", flush=True)  # fmt: skip
        return bool(result["fits"])

    return search_largest(fits, start, resolution)


def _smallest_oom(trials: list[dict], strategy: str) -> dict | None:
    failed = [t for t in trials if t["strategy"] == strategy and not t["fits"]]
    return min(failed, key=lambda t: t["width"]) if failed else None


def markdown(summary: dict) -> str:
    gib = summary["limit_bytes"] / 2**30
    best, trials = summary["largest"], summary["trials"]
    dp = best["dp"]["params"]
    dp_oom = _smallest_oom(trials, "dp")
    lines = [
        "# ShardedDataParallel: the largest model that trains on 4 processes, per strategy",
        "",
        f"Command: `{summary['command']}` ({summary['date']}; {summary['machine']}).",
        "",
        f"Measured under a memory cgroup limit of **{gib:g} GiB** (no swap) holding `loom run -n 4` and its four "
        "workers, standing for the issue's 24 GiB machine (the machine is shared: filling all of it would take "
        "it from everyone else). Each strategy trains an MLP of 8 hidden `Linear(width, width)` layers "
        "(`loom_bench.sharded_capacity_worker`) with Adam in float32 for 2 steps, global batch 32; "
        "the width is grown by 1.4x until the kernel's OOM killer ends the job, then bisected "
        f"(resolution {summary['resolution']:.0%} of the width). The fixed cost of 5 Python processes with "
        "torch (about 330 MiB per worker) is inside the limit too.",
        "",
        "| strategy | largest width that trains | parameters (M) | smallest that ran out (M) | vs DataParallel "
        "(largest / largest) | bracket | peak RSS per rank (MiB, largest) | cgroup peak (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for strategy, row in best.items():
        rss = ", ".join(f"{p / 2**20:.0f}" for p in row.get("peak_rss", []))
        peak = row.get("cgroup_peak")
        oom = _smallest_oom(trials, strategy)
        bracket, oom_m = "", "" if oom is None else f"{oom['params'] / 1e6:.1f}"
        if oom is not None and dp_oom is not None:
            bracket = f"{row['params'] / dp_oom['params']:.2f}-{oom['params'] / dp:.2f}x"
        lines.append(
            f"| {LABELS[strategy]} | {row['width']} | {row['params'] / 1e6:.1f} | "
            f"{oom_m} | {row['params'] / dp:.2f}x | {bracket} | "
            f"{rss} | {'' if peak is None else f'{peak / 2**20:.0f}'} |"
        )
    ratio = best.get("stage3", {}).get("params", 0) / dp
    verdict = "met" if ratio >= 3.5 else "not met"
    lines += [
        "",
        "The bracket: what the ratio can be given the search's resolution, from (this strategy's largest that "
        "trained / DataParallel's smallest that ran out) to (this strategy's smallest that ran out / "
        "DataParallel's largest that trained).",
        "",
        f"Target (stage 3 at least 3.5x DataParallel's parameters): **{verdict}** ({ratio:.2f}x, the largest "
        f"found of each, under the {gib:g} GiB limit).",
        "",
        "Every trial (width: fits / out of memory): "
        + "; ".join(f"{t['strategy']} {t['width']}: {'fits' if t['fits'] else 'OOM'}" for t in trials),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loom_bench.sharded_capacity", description=__doc__)
    parser.add_argument("--limit-gib", type=float, default=3.0)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--start-width", type=int, default=512)
    parser.add_argument("--resolution", type=float, default=0.04)
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per trial")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports"))
    args = parser.parse_args(argv)
    cgroup = MemoryCgroup(int(args.limit_gib * 2**30), f"loom-capacity-{os.getpid()}")
    started = time.monotonic()
    trials: list[dict] = []
    largest: dict[str, dict] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="loom-capacity-") as tmp:
            start = args.start_width
            for strategy in args.strategies.split(","):
                print(
                    f"loom_bench.sharded_capacity: {LABELS[strategy]} under {args.limit_gib:g} GiB",
                    flush=True,
                )
                width = largest_width(
                    cgroup, strategy, start, args.resolution, args.timeout, trials, Path(tmp)
                )
                largest[strategy] = next(
                    t for t in reversed(trials) if t["strategy"] == strategy and t["width"] == width
                )
                if strategy == "dp":
                    start = width  # every sharded stage holds at least what DataParallel does
    finally:
        cgroup.close()
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - started),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": "python -m loom_bench.sharded_capacity "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "limit_bytes": cgroup.limit_bytes,
        "resolution": args.resolution,
        "largest": largest,
        "trials": trials,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharded_capacity.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary)
    (args.out / "sharded_capacity.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
