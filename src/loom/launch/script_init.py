"""A script's own ``torch.distributed.init_process_group()`` under ``loom run``: it joins loom's store.

A DDP script written for ``torchrun`` calls ``init_process_group()`` itself (``env://`` by default). Under ``loom
run`` MASTER_ADDR:MASTER_PORT is loom's authenticated store (`loom.net.store`), which torch's ``TCPStore`` client
cannot join (it would retry for its 30-minute timeout). So `install`, called by `loom.launch.worker` before the
script runs (never at ``import loom``), routes ``env://`` and ``tcp://MASTER_ADDR:MASTER_PORT`` to a
`loom.net.store.LoomStore` client under the job's ``LOOM_STORE_PREFIX`` (one per restart and round; a group made
again after ``destroy_process_group()`` gets keys of its own), and refuses at once, with the fix, a ``TCPStore`` at
that address and a script's own group under ``--on-worker-failure heal`` (whose members change between steps).
``destroy_process_group()`` keeps the groups it destroys alive (`_kept`). User-facing: docs/launching.md.

It replaces the ``env`` and ``tcp`` entries of torch's rendezvous handler table (``register_rendezvous_handler``
refuses a scheme it already has), so ``init_process_group`` itself, and every library calling it
(``init_device_mesh``), is untouched; other ``tcp://`` addresses and ``file://`` stay torch's own.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from loom.errors import StoreNotForTorch

# The module, not the function of the same name that torch.distributed exports over it.
torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")
c10d = importlib.import_module("torch.distributed.distributed_c10d")

__all__ = ["install", "uninstall", "loom_store_address", "StoreNotForTorch"]

_FIX = (
    "HINT: call torch.distributed.init_process_group() with the default init_method (env://): under `loom run` "
    "it joins loom's authenticated store; or call loom.init(). A TCPStore of your own needs a port of its own"
)


_installed: dict[str, Any] = {}
"""What `install` replaced (torch's handlers and ``TCPStore``), for `uninstall`."""
_stores: list[Any] = []
"""Every store handed to torch: torch keeps only the C++ side of a Python store, and a call to one whose Python
object was collected fails ("Not implemented"), so each lives as long as the process."""
_kept: list[Any] = []
"""Every process group the script destroyed, kept until the process ends, which `loom.launch.worker` ends without
running destructors (`loom.launch.worker.finish`). A group's last reference usually goes when the script's
``main()`` returns (its DDP model holds it), and a gloo group's destructor waits for a thread of its own that may
be waiting for the GIL the main thread holds while it runs that destructor: the job trained and never ended."""


def loom_store_address() -> tuple[str, int] | None:
    """``(MASTER_ADDR, MASTER_PORT)`` when they name loom's store (``loom run`` sets ``LOOM_STORE_PREFIX``)."""
    addr, port = os.environ.get("MASTER_ADDR", "").strip(), os.environ.get("MASTER_PORT", "").strip()
    if "LOOM_STORE_PREFIX" not in os.environ or not addr or not port.isdigit():
        return None
    return addr, int(port)


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return socket.gethostbyname(a) == socket.gethostbyname(b)
    except OSError:
        return False


def _is_loom_store(host: str | None, port: int | None) -> bool:
    where = loom_store_address()
    return where is not None and port == where[1] and host is not None and _same_host(host, where[0])


def _join_loom_store(url: str, timeout: datetime.timedelta) -> Iterator[tuple[Any, int, int]]:
    """The rendezvous torch's ``env://`` handler would do, on loom's store: ``(store, rank, world_size)``."""
    query = dict(pair.split("=", 1) for pair in urlparse(url).query.split("&") if "=" in pair)
    rank = int(query.get("rank", os.environ.get("RANK", "0")))
    world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", "1")))
    if os.environ.get("LOOM_ON_WORKER_FAILURE") == "heal":
        raise StoreNotForTorch(
            f"rank {rank}: init_process_group() under `loom run --on-worker-failure heal`: healing changes the "
            "members between steps, which a default process group of every rank cannot follow. HINT: run with "
            "--on-worker-failure stop (and --max-restarts N to restart the group), or train with "
            "loom.DataParallel, which heals"
        )
    from loom.net.store import LoomStore, job_secret  # the launcher's store; only under `loom run`

    addr, port = loom_store_address() or ("", 0)
    # Every rank makes its groups in the same order (as torch requires), so the count keys each group apart:
    # a group made again after destroy_process_group() does not meet the stale keys of the one before.
    prefix = f"{os.environ['LOOM_STORE_PREFIX']}script{len(_stores)}/"
    bound = min(60.0, timeout.total_seconds())
    store = LoomStore(addr, port, job_secret(), prefix=prefix, timeout=timeout,
                      connect_timeout_s=bound, io_timeout_s=bound)  # fmt: skip
    _stores.append(store)
    yield store, rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")  # torch's own words


def _env_handler(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs: Any):
    if loom_store_address() is None:  # e.g. the variables changed by the script: torch's own rendezvous
        return _installed["env"](url, timeout=timeout, **kwargs)
    return _join_loom_store(url, timeout)


def _tcp_handler(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs: Any):
    parsed = urlparse(url)
    if not _is_loom_store(parsed.hostname, parsed.port):
        return _installed["tcp"](url, timeout=timeout, **kwargs)
    return _join_loom_store(url, timeout)


def _checked_tcp_store(original: type) -> type:
    """``TCPStore`` that refuses loom's store address at once (torch's client would retry it for its timeout)."""

    class TCPStore(original):  # type: ignore[misc, valid-type]
        __doc__ = original.__doc__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            host = kwargs.get("host_name", args[0] if args else None)
            port = kwargs.get("port", args[1] if len(args) > 1 else None)
            if _is_loom_store(host, port):
                raise StoreNotForTorch(
                    f"rank {os.environ.get('RANK', '?')}: torch.distributed.TCPStore({host!r}, {port}) points at "
                    "MASTER_ADDR:MASTER_PORT, which under `loom run` is loom's authenticated store: a TCPStore "
                    f"cannot join it (it would retry until its timeout). {_FIX}"
                )
            super().__init__(*args, **kwargs)

    TCPStore.__qualname__ = TCPStore.__name__ = original.__name__
    TCPStore.__module__ = original.__module__
    return TCPStore


def install() -> None:
    """Route the script's ``env://`` and ``tcp://MASTER_ADDR:MASTER_PORT`` rendezvous to loom's store, and refuse
    a ``TCPStore`` at that address (see the module docstring). Does nothing outside ``loom run`` (no
    ``LOOM_STORE_PREFIX``) or when already installed; undone by `uninstall`."""
    if _installed or loom_store_address() is None:
        return
    handlers = torch_rendezvous._rendezvous_handlers
    _installed.update(env=handlers["env"], tcp=handlers["tcp"], TCPStore=dist.TCPStore)
    handlers["env"], handlers["tcp"] = _env_handler, _tcp_handler
    dist.TCPStore = _checked_tcp_store(dist.TCPStore)  # type: ignore[misc, assignment]
    _installed["destroy"] = c10d.destroy_process_group
    for module in (dist, c10d):
        setattr(module, "destroy_process_group", _keeping(_installed["destroy"]))  # noqa: B010 (no stub attr)


def _keeping(original: Any) -> Any:
    """torch's ``destroy_process_group``, which first keeps the groups it destroys alive (`_kept`)."""

    def destroy_process_group(group: Any = None) -> None:
        everything = group is None or group == c10d.GroupMember.WORLD
        _kept.extend(list(c10d._world.pg_map) if everything else [group])
        original(group)

    destroy_process_group.__doc__ = original.__doc__
    return destroy_process_group


def uninstall() -> None:
    """Put torch's handlers and ``TCPStore`` back (tests; a worker process ends with its script)."""
    if not _installed:
        return
    handlers = torch_rendezvous._rendezvous_handlers
    handlers["env"], handlers["tcp"] = _installed.pop("env"), _installed.pop("tcp")
    dist.TCPStore = _installed.pop("TCPStore")  # type: ignore[misc]
    original = _installed.pop("destroy")
    for module in (dist, c10d):
        setattr(module, "destroy_process_group", original)  # noqa: B010 (mypy sees no such attribute)
