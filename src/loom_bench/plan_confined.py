"""A command run inside a memory cgroup of its own (root, cgroup v1 or v2): `loom plan`'s "fits" verdict checked.

`loom plan --memory-per-proc L` calls a configuration feasible when its predicted peak RSS per process is at
most ``L``; a user who has ``L`` per process has, on one host, ``N x L`` for the job's ``N`` processes (a
container's limit, a machine's memory). `run_confined` runs a whole ``loom run`` job (its launcher, the zygote
that forks the workers, the workers, any parameter servers) in one new memory cgroup limited to that: every
page any of them touches from birth is charged once, as the kernel charges a container. No swap: past the
limit the kernel reclaims what it can and then kills a process, and the job fails. The strictest ``L`` a
verdict allows is the prediction itself, which is what `loom_bench.plan_accuracy --cgroup` sets.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

__all__ = ["run_confined"]

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
PREFIX = "loom-bench-"


def _group(limit_bytes: int) -> tuple[Path, str]:
    """A new memory cgroup limited to ``limit_bytes`` without swap; its path and its peak-usage file's name."""
    v1 = (V1 / "memory.limit_in_bytes").exists()
    group = (V1 if v1 else V2) / f"{PREFIX}{os.getpid()}-{os.urandom(3).hex()}"
    group.mkdir()
    if v1:
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit_bytes))
        return group, "memory.max_usage_in_bytes"
    (group / "memory.max").write_text(str(limit_bytes))
    (group / "memory.swap.max").write_text("0")
    return group, "memory.peak"


def run_confined(
    command: list[str], limit_bytes: int, timeout_s: float
) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``command`` with it and all it starts in a new memory cgroup of ``limit_bytes``; returns the finished
    process and the group's peak charged bytes (0 where the kernel does not say). Raises OSError where cgroups
    cannot be written (not root, no memory controller)."""
    group, peak_file = _group(limit_bytes)
    procs = str(group / "cgroup.procs")

    def join() -> None:  # in the child, before it runs the command: everything it starts is charged here
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False,
                              preexec_fn=join)  # fmt: skip
        peak = 0
        with contextlib.suppress(OSError, ValueError):
            peak = int((group / peak_file).read_text())
        return done, peak
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()
