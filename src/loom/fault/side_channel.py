"""The watchdog's side channel: a client of the job's store of its own, and how this host is named on it.

The hang watchdog and the heartbeats talk through the job's store (loom's authenticated store under ``loom run``,
a ``TCPStore`` under ``torchrun``), never through the process group, whose collectives may be the stuck thing;
every call is bounded by `STORE_CALL_S`, so a watchdog thread never waits long on a store gone or cut off.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import warnings
from typing import Any

import torch.distributed as dist

from loom.net.interfaces import route_address

__all__ = ["STORE_CALL_S", "host_description", "open_side_channel"]

STORE_CALL_S = 3.0
"""Longest one store call of the watchdog may take (connecting included)."""


def open_side_channel() -> Any:
    """A client of the job's TCP store of its own (not shared with the main thread, which may be blocked in
    it), else the process group's store, else None (the watchdog then only counts, with a warning)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if addr and port.isdigit() and "LOOM_STORE_PREFIX" in os.environ:
        from loom.net.store import LoomStore, job_secret  # `loom run`'s store (authenticated)

        with contextlib.suppress(Exception):
            return LoomStore(
                addr, int(port), job_secret(), prefix=os.environ["LOOM_STORE_PREFIX"],
                timeout=datetime.timedelta(seconds=STORE_CALL_S), connect_timeout_s=STORE_CALL_S,
                io_timeout_s=STORE_CALL_S,
            )  # fmt: skip
    elif addr and port.isdigit():
        with contextlib.suppress(Exception):
            return dist.TCPStore(
                addr,
                int(port),
                is_master=False,
                timeout=datetime.timedelta(seconds=STORE_CALL_S),  # bounds every call
                wait_for_workers=False,
            )
    with contextlib.suppress(Exception):
        return dist.distributed_c10d._get_default_store()
    warnings.warn("loom watchdog: no store to publish progress to; hangs will not be diagnosed nor stragglers "
                  "named", stacklevel=3)  # fmt: skip
    return None


def host_description() -> str:
    """This host in words for the others' reports: ``node N, ADDRESS`` (the node from ``GROUP_RANK``, set by the
    launcher; the address this host reaches ``MASTER_ADDR`` from, else its host name)."""
    address = socket.gethostname()
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError):
            local = route_address(master)
            if not local.startswith("127."):
                address = local
    node = os.environ.get("GROUP_RANK")
    return f"node {node}, {address}" if node else address
