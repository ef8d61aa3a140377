"""Where this process stands in the job: rank, world size, local rank, backend (user's view: docs/concepts.md).

`init()` reads the environment a launcher leaves (`loom run` and `torchrun` both set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT: `loom.launcher_env`), joins the default process group and returns a `Topology`; under
`loom run` (``LOOM_STORE_PREFIX`` set) the group meets in loom's authenticated store at MASTER_ADDR:MASTER_PORT
(`loom.net.store`), under ``torchrun`` at ``env://`` as torch does. A job of one process gets what torchrun gives
it: a default group of one (gloo over an in-memory store, on loopback), so the script's own ``torch.distributed``
calls (``get_rank()``, ``barrier()``, ``destroy_process_group()``) work as under torchrun; loom runs no collective
in it (``Topology.backend`` stays ``"none"``). Only an explicit `init()` starts that group: `current()` alone (a
strategy built without `init()`, as tests do) leaves torch's global state untouched.

The topology is an ordinary object handed to strategies explicitly (``topology=``); `current()` returns the one
`init()` made, for scripts that do not want to carry it around.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from loom.devices import MIXED_BACKEND, DeviceChoice, choose_device
from loom.launcher_env import join_env_store, read_launcher_env

__all__ = ["Topology", "init", "current", "shutdown"]


@dataclass(frozen=True)
class Topology:
    """This process's place in the job."""

    rank: int
    """Global rank, 0 ≤ rank < world_size."""
    world_size: int
    """Number of worker processes in the job."""
    local_rank: int
    """Rank among the workers on this host (selects the GPU when there is one)."""
    local_world_size: int
    """Number of workers on this host."""
    backend: str
    """Process-group backend: ``gloo`` on CPU (and on shared GPUs), ``nccl`` on a GPU of its own (the default
    group is then ``cpu:gloo,cuda:nccl``: loom's CPU control collectives travel beside NCCL), ``none`` for one
    process."""
    device_name: str = "cpu"
    """Where this process trains: ``cpu`` or ``cuda:K`` (`loom.devices`: the device rule)."""
    shared_gpu: bool = False
    """Several local ranks on one GPU (``loom run --share-gpus``): collectives over gloo, no point-to-point."""
    process_group: Any = field(default=None, compare=False, repr=False)
    """The process group of every process of the job; None: torch's default group (the one `init()` joins).
    Given, the job runs on it alone (a test's ranks as threads, each with its own group: `tests/threads.py`)."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that prints and writes job-wide files."""
        return self.rank == 0

    @property
    def group(self) -> Any:
        """The group a collective over every process of the job runs on: `process_group`, else torch's default
        group (``dist.group.WORLD``; None before one is joined)."""
        if self.process_group is not None:
            return self.process_group
        return dist.group.WORLD if dist.is_available() else None

    @property
    def device(self) -> torch.device:
        """The device this process trains on (`device_name`)."""
        return torch.device(self.device_name)


_current: Topology | None = None


def _pick_backend(requested: str | None, choice: DeviceChoice) -> str:
    """The default group's backend: the device rule's (`loom.devices`), or the one asked for, checked against
    the device (NCCL needs a GPU of the process's own)."""
    if requested is None:
        return choice.backend
    if requested not in ("gloo", "nccl"):
        raise ValueError(f"backend={requested!r} is not supported; use 'gloo' or 'nccl'")
    if requested == "nccl":
        if choice.device == "cpu" or choice.shared_gpu:
            raise ValueError(
                f"backend='nccl' needs a GPU of this process's own, but it trains on {choice.device}"
                f"{' (shared with other ranks)' if choice.shared_gpu else ''}. HINT: backend='gloo', or one process "
                "per GPU"
            )
        return MIXED_BACKEND
    return "gloo"


def init(backend: str | None = None, timeout_s: float = 1800.0, device: str | None = None) -> Topology:
    """Join the job this process belongs to and return its topology.

    ``device``: ``auto`` (the default), ``cpu`` or ``cuda``, else ``LOOM_DEVICE``; the rule is `loom.devices`'.

    ``timeout_s`` bounds each collective in the backend (PyTorch's gloo default, 30 minutes), so that work one
    rank does alone between collectives (rank-0-only evaluation, a checkpoint) is ordinary; a true hang is
    stopped much earlier by loom's watchdog (`loom.fault.watchdog`, its hang timeout).

    One process: a process group of one for the script's own ``torch.distributed`` calls. Idempotent: a second
    call returns the same topology. Registers `shutdown()` to run at exit.
    """
    topo = _join(backend, timeout_s, device)
    if topo.world_size == 1 and dist.is_available() and not dist.is_initialized():
        _start_group_of_one(timeout_s)
    return topo


def _start_group_of_one(timeout_s: float) -> None:
    """The default process group torchrun's one process would have: gloo, one rank, an in-memory store. Nobody
    connects to it, so gloo listens on loopback (``GLOO_SOCKET_IFNAME`` for this call, unless the user set it)."""
    loopback = next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
    unset = "GLOO_SOCKET_IFNAME" not in os.environ
    if unset and loopback is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    hook = sys.excepthook
    try:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
    finally:
        if unset:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        # torch prefixes every traceback line with "[rank0]:", this group's rank, which is not the job's under
        # healing (the launcher's "[rank1]: [rank0]: ..."); the launcher labels each line itself.
        sys.excepthook = hook
    atexit.register(shutdown)


def _join(backend: str | None, timeout_s: float, device: str | None = None) -> Topology:
    """The topology from the launcher's environment; joins the default process group when there are peers."""
    global _current
    if _current is not None:
        return _current
    world_size, rank, local_rank, local_world_size = read_launcher_env()  # each variable checked, named
    choice = choose_device(device, local_rank, local_world_size)
    if choice.device != "cpu":
        torch.cuda.set_device(torch.device(choice.device))
    where: dict[str, Any] = {"device_name": choice.device, "shared_gpu": choice.shared_gpu}
    if world_size == 1:
        _current = Topology(0, 1, 0, 1, "none", **where)
        return _current
    chosen = _pick_backend(backend, choice)
    short = "nccl" if chosen == MIXED_BACKEND else chosen
    if os.environ.get("LOOM_ON_WORKER_FAILURE") == "heal" and "LOOM_STORE_PREFIX" in os.environ:
        # Healing: members change between steps, so no group of every rank is ever formed (the default group
        # cannot shrink); the job's strategy builds each membership epoch's group on the launcher's store
        # (`loom.fault.quorum`), and torch.distributed gets a group of one for the script's own calls.
        global _store
        _store = _job_store(rank, timeout_s)
        if not dist.is_initialized():
            _start_group_of_one(timeout_s)
        _current = Topology(rank, world_size, local_rank, local_world_size, "gloo", **where)
        return _current
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "LOOM_STORE_PREFIX" in os.environ:
            # Kept here while the group lives: torch holds only the C++ side of a Python store, and a call to
            # a store whose Python object was collected fails ("Not implemented"), e.g. in every new_group.
            _store = _job_store(rank, timeout_s)
            meet: dict[str, Any] = {"store": _store}
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun: its agent bounds the join
            meet = {"init_method": "env://"}
        else:  # no agent (plain `python` with the variables set): a join bounded by LOOM_JOIN_TIMEOUT_S
            meet = {"store": join_env_store(rank, world_size, timeout_s)}
        hook = sys.excepthook
        dist.init_process_group(backend=chosen, rank=rank, world_size=world_size, timeout=timeout, **meet)
        if "LOOM_STORE_PREFIX" in os.environ:  # loom run labels each line; torch's hook: twice
            sys.excepthook = hook
        # gloo's connections finish on each rank in its own time: a rank that went on and ended at once (a
        # setup every rank refuses) closed its sockets under a peer still connecting, which then failed with
        # "Gloo connectFullMesh failed ... Connection closed by peer" instead of the refusal. A CPU tensor's
        # all-reduce runs on gloo in either group (`gloo`, or `cpu:gloo,cuda:nccl`, where a barrier would go
        # to NCCL and make its communicator before the job needs one)
        dist.all_reduce(torch.zeros(1), group=dist.group.WORLD)
    _watch_uncaught_exceptions()
    _current = Topology(rank, world_size, local_rank, local_world_size, short, **where)
    atexit.register(shutdown)
    return _current


_store = None
"""The `loom.net.store.LoomStore` the process group meets in under ``loom run`` (see `init`)."""


def _job_store(rank: int, timeout_s: float):
    """A client of the store `loom run` hosts (every call bounded by ``timeout_s``); MASTER_ADDR and MASTER_PORT
    were checked by `loom.launcher_env.read_launcher_env`."""
    from loom.net.store import LoomStore, job_secret  # the launcher's store: imported only under `loom run`

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    bound = min(60.0, timeout_s)
    return LoomStore(
        addr, port, job_secret(), prefix=os.environ["LOOM_STORE_PREFIX"],
        timeout=datetime.timedelta(seconds=timeout_s), connect_timeout_s=bound, io_timeout_s=bound,
    )  # fmt: skip


def job_store():
    """The client of the launcher's store this process joined through (None outside ``loom run``'s supervised
    modes); a healing job builds its membership epochs on it."""
    return _store


def current() -> Topology:
    """The topology `init()` made; joins the job first if nobody has (without `init()`'s group of one)."""
    return _current if _current is not None else _join(None, 1800.0)


def _note_uncaught_exception(kind, value, tb) -> None:
    global _failed
    _failed = True
    (_previous_excepthook or sys.__excepthook__)(kind, value, tb)


_failed = False
_previous_excepthook = None


def _watch_uncaught_exceptions() -> None:
    """Note an uncaught exception so `shutdown` skips its exit barrier (the failing rank must exit at once).
    Installed by `init()` for a distributed job, never at import, and undone by `shutdown()`."""
    global _previous_excepthook
    if _previous_excepthook is None:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _note_uncaught_exception


def _restore_excepthook() -> None:
    global _previous_excepthook
    if _previous_excepthook is not None and sys.excepthook is _note_uncaught_exception:
        sys.excepthook = _previous_excepthook
    _previous_excepthook = None


def shutdown(barrier_timeout_s: float = 60.0) -> None:
    """Leave the process group (safe to call twice, without `init()`, or after the script's own
    ``destroy_process_group()``).

    On a normal exit the ranks first meet at a barrier, so none tears its connections down while a peer still
    uses them. After an uncaught exception there is none: the failing rank exits at once, the launcher stops the
    others.
    """
    global _current
    if dist.is_available() and dist.is_initialized():
        if not _failed:
            try:
                if dist.get_backend() == "gloo":
                    timeout = datetime.timedelta(seconds=barrier_timeout_s)
                    dist.monitored_barrier(group=dist.group.WORLD, timeout=timeout)
                else:
                    dist.barrier(group=dist.group.WORLD)
            except RuntimeError as error:
                print(f"loom: rank {dist.get_rank()}: exit barrier failed: {error}", file=sys.stderr)
        from loom.comm.links import close_links  # here: loom.comm imports this module

        close_links()  # the ring's sockets go with the group they were made for
        dist.destroy_process_group()
    global _store
    _store = None
    _restore_excepthook()
    _current = None
