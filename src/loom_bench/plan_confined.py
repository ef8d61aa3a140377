"""A `loom.plan.trial` worker confined to a memory cgroup at a predicted peak RSS (root, cgroup v1 or v2).

    loom run -n N -m loom_bench.plan_confined PEAK_BYTES verify --out F ... SCRIPT [ARGS...]

Each worker moves itself into a memory cgroup of its own, ``loom-bench-<pid>``, and runs `loom.plan.trial`'s
``main`` with the rest of its arguments. The check is of `loom plan`'s peak-RSS prediction: a "fits" verdict
under ``--memory-per-proc L`` means a predicted peak at most ``L``, so the strictest limit is the prediction
itself. A cgroup charges what its process touches after it joined, not the pages it shares with the zygote that
forked it (torch's code and the interpreter: part of its RSS), nor, on kernels that no longer move charges, what
it held before joining; so the limit set is the predicted peak less what the process's RSS holds that the
cgroup was not charged for when it joined: exceeding it is exceeding the predicted RSS (or, where the process
frees pages charged outside and allocates new ones, less than that: the check errs on the strict side). Past it the kernel reclaims and then kills the worker (no swap here), and the job fails.
`loom_bench.plan_accuracy --cgroup` runs every configuration once this way; `remove_groups` cleans up.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

__all__ = ["confine", "remove_groups"]

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
PREFIX = "loom-bench-"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def confine(peak_bytes: int) -> int:
    """Move this process into a new memory cgroup limited to ``peak_bytes`` of RSS (module docstring); returns
    the limit written. Raises OSError where cgroups cannot be written (not root, no memory controller)."""
    v1 = (V1 / "memory.limit_in_bytes").exists()
    group = (V1 if v1 else V2) / f"{PREFIX}{os.getpid()}"
    group.mkdir()
    if v1:  # move the pages it maps alone (newer kernels refuse: what it holds then stays charged outside)
        with contextlib.suppress(OSError):
            (group / "memory.move_charge_at_immigrate").write_text("3")
    (group / "cgroup.procs").write_text(str(os.getpid()))
    usage = int((group / ("memory.usage_in_bytes" if v1 else "memory.current")).read_text())
    limit = max(usage + (1 << 20), peak_bytes - max(0, _rss() - usage))
    if v1:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit))
    else:
        (group / "memory.max").write_text(str(limit))
        (group / "memory.swap.max").write_text("0")
    return limit


def remove_groups() -> None:
    """Remove every empty ``loom-bench-*`` memory cgroup (their workers have exited)."""
    for root in (V1, V2):
        for group in root.glob(f"{PREFIX}*") if root.exists() else ():
            with contextlib.suppress(OSError):
                group.rmdir()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    limit = confine(int(args[0]))
    print(f"plan_confined: pid {os.getpid()} limited to {limit} bytes of charged memory", file=sys.stderr)
    from loom.plan.trial import main as trial

    return trial(args[1:])


if __name__ == "__main__":
    sys.exit(main())
