"""Connect to Ray for one loom job: an existing cluster, or a local instance started locked down.

A local instance (no ``address``) has no dashboard, binds every Ray process to loopback
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` while it starts: otherwise Ray resolves the node address to the host's
outward one even when asked for 127.0.0.1; its object store and raylet sockets are Unix sockets), turns Ray's token
authentication on with a fresh token for this instance alone (in this process's environment, never written or
printed), so another local user cannot submit work to it, and Ray's usage statistics off. `disconnect` stops what
`connect` started (``ray.shutdown()``, then SIGKILL for stragglers naming this instance's session directory, never
a process found by name) and gives back what ``ray.init`` changed in this process and its shutdown leaves (Ray's
environment variables, the signal handlers, ``sys.excepthook``), so a notebook or a test suite goes on as before.
A cluster given by ``address`` keeps its own security settings and is only disconnected from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RayConnection", "connect", "disconnect", "session_processes", "tagged_processes"]


@dataclass
class RayConnection:
    """How this process is attached to Ray for the job, and what `disconnect` must undo."""

    connected_here: bool
    """True when `connect` called ``ray.init`` (False: the caller had connected already and stays connected)."""
    started_local: bool
    """True when `connect` started a local instance (stopped by `disconnect`)."""
    session_dir: str | None
    """The Ray session directory of a local instance this process started."""
    saved: _ProcessState | None = None
    """What ``ray.init`` changes in this process (restored by `disconnect`)."""


_RAY_SETS = ("RAY_", "PYTHONBREAKPOINT")
"""Environment variables ``ray.init`` (and `connect`) set in the driver's process and ``ray.shutdown`` leaves."""


@dataclass
class _ProcessState:
    """The driver's state ``ray.init`` changes and ``ray.shutdown`` leaves changed (the module docstring)."""

    env: dict[str, str]
    handlers: dict[int, Any]
    excepthook: Any

    @classmethod
    def capture(cls) -> _ProcessState:
        env = {k: v for k, v in os.environ.items() if k.startswith(_RAY_SETS)}
        return cls(env, {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}, sys.excepthook)

    def restore(self) -> None:
        for name in [k for k in os.environ if k.startswith(_RAY_SETS) and k not in self.env]:
            del os.environ[name]
        os.environ.update(self.env)
        if threading.current_thread() is threading.main_thread():  # signal handlers: main thread only
            for signum, handler in self.handlers.items():
                signal.signal(signum, handler)
        sys.excepthook = self.excepthook


def connect(address: str | None, num_cpus: int | None = None) -> RayConnection:
    """Attach to Ray: reuse this process's connection, join the cluster at ``address`` or ``RAY_ADDRESS``
    (``"auto"``: the one this node belongs to), or start a local instance with ``num_cpus`` CPUs (see the module
    docstring) -- a new one, never a ``ray start`` instance found on this machine."""
    import ray

    given = address or os.environ.get("RAY_ADDRESS") or None
    if given is not None and given.startswith("ray://"):
        raise ValueError(
            f"Ray address {given!r}: Ray Client addresses are not supported (the workers must reach the driver "
            "to join the job's store). HINT: run the driver on a node of the cluster (e.g. `ray job submit`) "
            "with --address auto or the GCS address HOST:PORT"
        )
    if ray.is_initialized():
        return RayConnection(False, False, None)
    saved = _ProcessState.capture()
    try:
        if given is None:
            return _start_local(num_cpus, saved)
        ray.init(address=given, log_to_driver=False, logging_level=logging.WARNING)
        return RayConnection(True, False, None, saved)
    except BaseException:  # a connection that failed leaves this process as it found it
        saved.restore()
        raise


def _start_local(num_cpus: int | None, saved: _ProcessState) -> RayConnection:
    import ray
    from ray._private import ray_constants

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # nothing about the job leaves the machine
    if os.environ.get("RAY_AUTH_MODE", "token") == "token" and not os.environ.get("RAY_AUTH_TOKEN"):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    _reset_auth()
    # Ray read the variable when it was imported; its node-address lookup reads this module attribute.
    cluster_flag = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            address="local",  # a new instance, even where `ray start` left one running on this machine
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_flag
    session = ray._private.worker._global_node.get_session_dir_path()  # type: ignore[attr-defined,union-attr]
    return RayConnection(True, True, session, saved)


def _reset_auth() -> None:
    """Have Ray forget the token it cached in this process (a previous instance's) and read ``RAY_AUTH_MODE``
    again (it read it when it was imported)."""
    with contextlib.suppress(ImportError):  # a Ray without token authentication
        from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

        AuthenticationTokenLoader.instance().reset_cache()
    with contextlib.suppress(ImportError):
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")


def session_processes(session_dir: str) -> list[int]:
    """Live processes of this user that are Ray's (a program or script of Ray's own comes first in the command
    line) and name ``session_dir`` (this instance): not, say, a ``tail -f`` of one of its logs."""
    needle, uid = session_dir.encode(), os.getuid()

    def ours(entry: Path) -> bool:
        if entry.stat().st_uid != uid:
            return False
        args = (entry / "cmdline").read_bytes().split(b"\0")
        return any(b"ray" in arg for arg in args[:2]) and any(needle in arg for arg in args)

    return _live_processes(ours)


def tagged_processes(name: str, value: str) -> list[int]:
    """Live processes whose environment holds ``name=value`` (for checks that a job left nothing behind)."""
    needle = f"{name}={value}".encode()
    return _live_processes(lambda entry: needle in (entry / "environ").read_bytes().split(b"\0"))


def _live_processes(match: Callable[[Path], bool]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if match(entry) and (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def disconnect(connection: RayConnection, grace_s: float = 5.0) -> list[int]:
    """Undo `connect`; returns the pids of a local instance's stragglers that had to be killed."""
    import ray

    if not connection.connected_here:
        return []
    ray.shutdown()
    killed: list[int] = []
    if connection.session_dir is not None:
        deadline = time.monotonic() + grace_s
        while session_processes(connection.session_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in session_processes(connection.session_dir):
            with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, or not ours after all
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    if connection.saved is not None:
        connection.saved.restore()
    if connection.started_local:
        _reset_auth()
    return killed
