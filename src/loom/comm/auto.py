"""``auto``: pick native, ring, shm or hierarchical for each call, by topology and message size, from measurements.

As NCCL's tuning model and Open MPI's ``coll/tuned`` decision tables, but measured instead of modelled: the
fastest algorithm depends on where the processes are, on the message size (latency dominates small messages,
bandwidth large ones) and on the machine. So a group's first ``auto`` call times every one of its `candidates`
at a few sizes (`CALIBRATION_SIZES`, the median of `CALIBRATION_REPS` calls after one warm-up), and each call
then takes the fastest at the calibrated size nearest on a log scale.

Agreement: every rank must pick the same algorithm for the same call, or the job hangs. So the timing table is
the same everywhere (each entry is the slowest rank's time, an all-reduce MAX; a cached table is read by rank 0
and broadcast), and the choice is a deterministic function of it and the tensor's size. The table is cached per
host (`cache_path`; when to delete it: docs/strategies/data-parallel.md#how-gradients-are-averaged).

Limits: a calibration reflects the load of its moment on a shared machine; it adds a fraction of a second to
the first call; only float32 messages are timed (the choice is by bytes, whatever the dtype).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import socket
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from loom.comm.counters import Traffic, counters
from loom.comm.shm import ShmContext, context_for
from loom.settings import setting

__all__ = [
    "CALIBRATION_REPS",
    "CALIBRATION_SIZES",
    "Policy",
    "cache_path",
    "candidates",
    "choose_algorithm",
    "policy_for",
]

CALIBRATION_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
"""Message sizes (bytes) timed by the calibration."""
CALIBRATION_REPS = 5
"""Timed calls per algorithm and size, median kept (after one untimed warm-up, which also sets up shm)."""
_VERSION = 1

Algorithm = Callable[[torch.Tensor, str, "dist.ProcessGroup | None"], Traffic]


def candidates(ctx: ShmContext) -> tuple[str, ...]:
    """The algorithms worth timing for this topology: native and ring, plus shm on one host or hierarchical on
    several, where some host has several processes and shared memory is usable."""
    if ctx.unsupported or max(ctx.host_sizes) == 1:
        return ("native", "ring")
    return ("native", "ring", "shm" if len(ctx.host_sizes) == 1 else "hierarchical")


class Policy:
    """A calibration table and the choice it implies: the fastest algorithm at the nearest timed size."""

    def __init__(
        self, algorithms: tuple[str, ...], sizes: tuple[int, ...], seconds: list[list[float]]
    ) -> None:
        self.algorithms, self.sizes, self.seconds = algorithms, sizes, seconds
        """``seconds[a][s]``: slowest rank's time of one call of ``algorithms[a]`` on ``sizes[s]`` bytes."""
        # Sizes nearer (in log) to sizes[s] than to its neighbours use sizes[s]'s winner (ties: the first, native).
        self._bounds = [math.sqrt(a * b) for a, b in zip(sizes, sizes[1:], strict=False)]
        self._best = [algorithms[c.index(min(c))] for c in zip(*seconds, strict=True)]

    def choose(self, nbytes: int) -> str:
        return self._best[bisect.bisect_right(self._bounds, nbytes)]

    def __repr__(self) -> str:
        picks = ", ".join(f"{size} B: {best}" for size, best in zip(self.sizes, self._best, strict=True))
        return f"Policy({picks})"


def cache_path() -> Path:
    """This host's calibration file, keyed inside by world size and processes per host."""
    root = setting("LOOM_CACHE_DIR") or Path.home() / ".cache" / "loom"
    return Path(root) / f"allreduce-{socket.gethostname()}.json"


def _read_cache(key: str, algorithms: tuple[str, ...]) -> list[list[float]] | None:
    expected = (_VERSION, list(algorithms), list(CALIBRATION_SIZES))
    try:  # a damaged file or entry (not JSON, not a dict, a field missing) reads as no entry
        entry = json.loads(cache_path().read_text())["entries"][key]
        found = (entry["version"], entry["algorithms"], entry["sizes"])
        return entry["seconds"] if found == expected else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(key: str, algorithms: tuple[str, ...], seconds: list[list[float]]) -> None:
    path = cache_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):  # damaged: start over
            data = {"entries": {}}
    except (OSError, ValueError):
        data = {"entries": {}}
    data["entries"][key] = {
        "version": _VERSION,
        "algorithms": list(algorithms),
        "sizes": list(CALIBRATION_SIZES),
        "seconds": seconds,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent job reads the old or the new file, never half of one
    except OSError as error:
        warnings.warn(f"loom: could not write the all-reduce calibration to {path}: {error}", stacklevel=2)


def _calibrate(
    group: dist.ProcessGroup | None, names: tuple[str, ...], algorithms: Mapping[str, Algorithm]
) -> tuple[torch.Tensor, Traffic]:
    """Seconds of every timed call, ``[algorithm, size, repetition]``, as this rank saw them."""
    seconds = torch.zeros(len(names), len(CALIBRATION_SIZES), CALIBRATION_REPS, dtype=torch.float64)
    traffic = Traffic()
    for s, size in enumerate(CALIBRATION_SIZES):
        data = torch.zeros(size // 4, dtype=torch.float32)
        for a, name in enumerate(names):
            traffic = traffic.plus(algorithms[name](data, "sum", group))  # warm-up, and set-up
            for rep in range(CALIBRATION_REPS):
                dist.barrier(group=group)  # start together: a late rank would be charged to the others
                started = time.perf_counter()
                traffic = traffic.plus(algorithms[name](data, "sum", group))
                seconds[a, s, rep] = time.perf_counter() - started
    return seconds, traffic


def _load_or_calibrate(group: dist.ProcessGroup | None, algorithms: Mapping[str, Algorithm]) -> Policy:
    ctx = context_for(group)
    names, key = candidates(ctx), f"world={ctx.size},per_host={'+'.join(map(str, ctx.host_sizes))}"
    table = torch.zeros(1 + len(names) * len(CALIBRATION_SIZES), dtype=torch.float64)
    if ctx.rank == 0:
        cached = _read_cache(key, names)
        if cached is not None:
            table[0] = 1
            table[1:] = torch.tensor(cached, dtype=torch.float64).flatten()
    dist.broadcast(table, group=group, group_src=0)
    counters().record("setup", table.nbytes if ctx.rank == 0 else 0, 0 if ctx.rank == 0 else table.nbytes)
    if table[0] == 1:
        seconds = table[1:].view(len(names), -1)
    else:
        calls, traffic = _calibrate(group, names, algorithms)
        # Each call takes as long as its slowest rank; the median call resists a process descheduled once.
        dist.all_reduce(calls, op=dist.ReduceOp.MAX, group=group)  # the same table on every rank
        counters().record("setup", *traffic.plus(Traffic(calls.nbytes, calls.nbytes)))
        seconds = calls.median(dim=2).values
        if ctx.rank == 0:
            _write_cache(key, names, seconds.tolist())
    return Policy(names, CALIBRATION_SIZES, seconds.tolist())


_POLICIES: dict[object, Policy] = {}


def choose_algorithm(
    nbytes: int, group: dist.ProcessGroup | None, algorithms: Mapping[str, Algorithm]
) -> str:
    """The algorithm ``auto`` uses for an ``nbytes`` message on ``group``; calibrates (collectively) on first use
    with ``algorithms``, every candidate name's low-level function (`loom.comm.all_reduce` passes its own)."""
    key = group if group is not None else dist.group.WORLD
    if key not in _POLICIES:
        _POLICIES[key] = _load_or_calibrate(group, algorithms)
    return _POLICIES[key].choose(nbytes)


def policy_for(group: dist.ProcessGroup | None) -> Policy | None:
    """The policy ``auto`` follows on ``group``, or None before its first ``auto`` call there."""
    return _POLICIES.get(group if group is not None else dist.group.WORLD)
