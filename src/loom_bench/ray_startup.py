"""Start-up overhead of ``loom run --backend ray`` against ``loom run``, for a trivial 2-worker job.

The job: ``loom.init()``, one all-reduce of one number, exit -- so the wall time of the command is the cost of
starting and ending a job. Three ways, interleaved repetition by repetition so they share the machine's state:

- ``local``: ``loom run -n 2 job.py`` (the baseline: PyTorch's elastic agent, this host's processes);
- ``ray``: ``loom run --backend ray -n 2 job.py``, which starts a local Ray instance for the job and stops it;
- ``ray --address``: the same against a Ray instance already running (started once here, as on a cluster
  whose Ray is up), so only placement, actors and the ranks are paid.

Each run is a fresh ``loom`` process, timed from its start to its exit; medians over ``repetitions``. After each
run the benchmark checks that no process of it is left (every process it starts inherits a tag in its
environment: Ray's own processes from the command, the ranks from the driver). Before timing it takes
``/tmp/bench_lock`` (waiting while another benchmark holds it) and removes it after.

``python -m loom_bench.ray_startup [--repetitions 5] [--out benchmarks/reports]`` writes ``ray_startup.md`` and
``ray_startup.json``.
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
import uuid
from contextlib import contextmanager
from pathlib import Path

__all__ = ["measure_startup", "run_ray_startup_benchmark"]

JOB = """
import torch, torch.distributed as dist, loom
topo = loom.init()
x = torch.ones(1)
dist.all_reduce(x)
print(f"rank {topo.rank} sum {x.item():g}", flush=True)
"""
LOCK = Path("/tmp/bench_lock")


@contextmanager
def bench_lock(poll_s: float = 2.0):
    """Hold ``/tmp/bench_lock`` while timing: wait while it exists, create it, remove it at the end."""
    while True:
        try:
            fd = os.open(LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            time.sleep(poll_s)
    os.write(fd, f"loom_bench.ray_startup pid {os.getpid()}\n".encode())
    os.close(fd)
    try:
        yield
    finally:
        LOCK.unlink(missing_ok=True)


def _time_one(args: list[str], scratch: Path, env: dict[str, str]) -> float:
    from loom.ray.local import tagged_processes

    tag = uuid.uuid4().hex
    command = [sys.executable, "-m", "loom.cli", "run", *args, "-n", "2",
               "--run-dir", str(scratch / f"run-{tag}"), str(scratch / "job.py")]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(
        command, cwd=scratch, env=dict(env, LOOM_BENCH_TAG=tag), capture_output=True, text=True
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0 or "rank 1 sum 2" not in done.stdout:
        raise RuntimeError(f"{' '.join(args) or 'local'} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    deadline = time.monotonic() + 10.0
    while tagged_processes("LOOM_BENCH_TAG", tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = tagged_processes("LOOM_BENCH_TAG", tag)
    if left:
        raise RuntimeError(f"{' '.join(args) or 'local'}: processes left after the command ended: {left}")
    return elapsed


def measure_startup(repetitions: int) -> dict[str, list[float]]:
    """Wall seconds of each way, per repetition (see the module docstring)."""
    from loom.ray.local import connect, disconnect

    times: dict[str, list[float]] = {"local": [], "ray": [], "ray --address": []}
    with tempfile.TemporaryDirectory(prefix="loom-bench-ray-") as tmp:
        scratch = Path(tmp)
        (scratch / "job.py").write_text(JOB)
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        connection = connect(None, num_cpus=2)  # the instance already up, for `--address`
        try:
            import ray

            address = ray.get_runtime_context().gcs_address
            warm_env = dict(os.environ)  # holds the instance's token (set by `connect`)
            for _ in range(repetitions):
                times["local"].append(_time_one([], scratch, env))
                times["ray"].append(_time_one(["--backend", "ray"], scratch, env))
                times["ray --address"].append(
                    _time_one(["--backend", "ray", "--address", address], scratch, warm_env)
                )
        finally:
            disconnect(connection)
    return times


def _report(times: dict[str, list[float]], out: Path, command: str, load: str) -> Path:
    medians = {k: statistics.median(v) for k, v in times.items()}
    base = medians["local"]
    rows = [
        f"| `{'loom run' if k == 'local' else 'loom run --backend ' + k}` | {m:.2f} | {m - base:+.2f} | "
        f"{', '.join(f'{t:.2f}' for t in times[k])} |"
        for k, m in medians.items()
    ]
    text = "\n".join(
        [
            "# Start-up overhead of `loom run --backend ray` against `loom run`",
            "",
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {platform.node()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}; load average before: {load}.",
            f"Command: `{command}`.",
            "",
            "A trivial 2-worker job (`loom.init()`, one all-reduce of one number, exit), each run a fresh `loom` "
            "process timed from start to exit, the three ways interleaved; median of "
            f"{len(times['local'])} repetitions (seconds). `ray` starts a local Ray instance for the job and stops "
            "it; `ray --address` joins an instance already running. No process of any run was left behind.",
            "",
            "| command | median (s) | vs `loom run` (s) | each repetition (s) |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ray_startup.md"
    path.write_text(text)
    (out / "ray_startup.json").write_text(json.dumps({"times_s": times, "median_s": medians}, indent=1))
    return path


def run_ray_startup_benchmark(repetitions: int = 5, out_dir: Path = Path("benchmarks/reports")) -> int:
    command = f"python -m loom_bench.ray_startup --repetitions {repetitions}"
    with bench_lock():
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        times = measure_startup(repetitions)
    path = _report(times, out_dir, command, load)
    print(path.read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loom_bench.ray_startup", description=__doc__.splitlines()[0])
    p.add_argument("--repetitions", type=int, default=5, help="repetitions of each way (median reported)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/reports"), help="report directory")
    ns = p.parse_args(argv)
    return run_ray_startup_benchmark(ns.repetitions, ns.out)


if __name__ == "__main__":
    sys.exit(main())
