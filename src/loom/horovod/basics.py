"""Horovod's process queries and constants on loom's topology: `init`, `rank`, `size`, `Average`, ...

`init()` joins the job through `loom.init()`, then starts the negotiation engine (`loom.horovod._engine`) on a
gloo process group of its own, so that a script's own ``torch.distributed`` calls never interleave with
Horovod's. `shutdown()` stops the engine but keeps loom's process group (left by `loom.shutdown` at exit), so
``init -> shutdown -> init`` works as with Horovod's gloo controller.
"""

from __future__ import annotations

import atexit
import os
import threading

import torch.distributed as dist

import loom
from loom.errors import HostsUpdatedInterrupt
from loom.horovod import _engine

__all__ = [
    "Adasum",
    "Average",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "is_homogeneous",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "remove_process_set",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]

# Reduction operations, with Horovod's values (scripts compare and pass them around as ints).
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

HorovodInternalError = _engine.HorovodInternalError


def refuse(feature: str, hint: str = "") -> NotImplementedError:
    """The error for a Horovod feature loom does not implement (`NotImplementedError` is a `RuntimeError`)."""
    text = f"loom.horovod: {feature} is not supported by loom's Horovod API"
    return NotImplementedError(text + (f". HINT: {hint}" if hint else ""))


class ProcessSet:
    """Horovod's process set; only the global one (all ranks) exists in loom."""

    def __init__(self, ranks=None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None

    def _is_global(self) -> bool:
        return self.ranks is None or self.ranks == list(range(size()))

    def size(self) -> int:
        return size() if self._is_global() else len(self.ranks or [])

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return self._is_global() or rank() in (self.ranks or [])

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet(ranks={self.ranks})"


global_process_set = ProcessSet()


def check_process_set(process_set) -> None:
    """Refuse any process set but the global one (None, `global_process_set`, or a set of every rank)."""
    if process_set is not None and not (isinstance(process_set, ProcessSet) and process_set._is_global()):
        raise refuse(f"process set {process_set!r}", "use the global process set (the default)")


def add_process_set(process_set):
    raise refuse(
        "add_process_set (process sets)", "run the subgroups as separate jobs or use torch.distributed"
    )


def remove_process_set(process_set):
    raise refuse("remove_process_set (process sets)")


_lock = threading.Lock()
_engine_now: _engine.Engine | None = None
_group = None  # the engine's gloo group, made once per process (a collective) and kept across re-inits


def init(comm=None, process_sets=None) -> None:
    """Join the job (`loom.init`) and start the engine; idempotent, and callable again after `shutdown`.
    Refused: ``comm`` (MPI communicators), ``process_sets`` (loom has one global process set) and
    ``HOROVOD_TIMELINE`` naming a file (``DYNAMIC`` records nothing until `start_timeline`, itself refused)."""
    global _engine_now, _group
    if comm is not None:
        raise refuse("init(comm=...) (MPI communicators)", "launch with `loom run -n N`")
    if process_sets not in (None, [], "dynamic"):
        raise refuse("init(process_sets=...)")
    timeline = os.environ.get("HOROVOD_TIMELINE", "")
    if timeline and timeline.upper() != "DYNAMIC":
        raise refuse(
            f"the timeline (HOROVOD_TIMELINE={timeline})", "unset HOROVOD_TIMELINE; see `loom report`"
        )
    with _lock:
        if _engine_now is not None:
            return
        topo = loom.init()
        if topo.is_distributed and _group is None:
            _group = dist.new_group(backend="gloo")
        _engine_now = _engine.Engine(topo.rank, topo.world_size, _group)
        atexit.unregister(shutdown)  # registered once, after loom.init's: runs before loom leaves the group
        atexit.register(shutdown)


def shutdown() -> None:
    """Stop the engine (every rank must call it; outstanding operations fail). Safe to call twice."""
    global _engine_now
    with _lock:
        engine, _engine_now = _engine_now, None
    if engine is not None:
        engine.stop()


def is_initialized() -> bool:
    return _engine_now is not None


def engine() -> _engine.Engine:
    """The running engine; the error Horovod gives when `init` was not called."""
    if _engine_now is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _engine_now


def _topo():
    engine()
    return loom.current()


def size() -> int:
    return _topo().world_size


def rank() -> int:
    return _topo().rank


def local_size() -> int:
    return _topo().local_world_size


def local_rank() -> int:
    return _topo().local_rank


def cross_size() -> int:
    """Number of hosts (loom runs the same number of workers on every host)."""
    topo = _topo()
    return topo.world_size // topo.local_world_size


def cross_rank() -> int:
    topo = _topo()
    return topo.rank // topo.local_world_size


def _fixed(name: str, answer: bool | int):
    """A Horovod build or capability query whose answer is fixed in loom: gloo only, no MPI, NCCL, CCL, DDL,
    CUDA or ROCm controller, the same number of workers on every host."""

    def query() -> bool | int:
        return answer

    query.__name__ = query.__qualname__ = name
    return query


is_homogeneous = _fixed("is_homogeneous", True)
gloo_enabled = _fixed("gloo_enabled", True)
gloo_built = _fixed("gloo_built", True)
nccl_built = _fixed("nccl_built", 0)
mpi_threads_supported = _fixed("mpi_threads_supported", False)
mpi_enabled = _fixed("mpi_enabled", False)
mpi_built = _fixed("mpi_built", False)
ddl_built = _fixed("ddl_built", False)
ccl_built = _fixed("ccl_built", False)
cuda_built = _fixed("cuda_built", False)
rocm_built = _fixed("rocm_built", False)


def start_timeline(file_path, mark_cycles=False) -> None:
    raise refuse("the timeline (start_timeline)", "loom's step traces: `loom run --trace-steps A:B`")


def stop_timeline() -> None:
    raise refuse("the timeline (stop_timeline)")
