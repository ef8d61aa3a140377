"""Start the worker processes of a job on PyTorch's elastic agent (the engine behind ``torchrun``).

The agent starts ``nproc`` workers on this node, watches them, stops all of them when one fails, and restarts the
group up to ``max_restarts`` times. loom adds (user-facing: docs/launching.md) its own rendezvous
(`loom.launch.rendezvous`: every peer proves the job secret, nothing is unpickled, every call is bounded, each
attempt is a fresh round of keys), loopback addresses for one-node jobs (a multi-node job's store listens on the
master address only and needs ``LOOM_JOB_SECRET`` unless ``insecure_no_secret``), output lines prefixed with their
rank, the workers' logs under the run directory, and one line naming the failing rank and its error, or a node
this one lost contact with, instead of the agent's table.

Workers run `loom.launch.worker`; what is started, and its checks, are `loom.launch.spec`'s (`LaunchSpec`). Under
``--on-worker-failure continue|heal`` the agent is not used: `loom.launch.supervise` (`loom.launch.heal_nodes`
across nodes) starts the workers itself.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from loom.launch.bounds import refuse
from loom.launch.spec import LaunchSpec, endpoint_and_addr, run_id_of, secret_of
from loom.net.interfaces import interface_of
from loom.observe.trace import merge_traces_and_say

if TYPE_CHECKING:
    from loom.launch.servers import ServerGroup

__all__ = ["launch"]


def _worker_env(spec: LaunchSpec, local_addr: str) -> None:
    """Environment every worker inherits (the agent copies this process's environment).

    gloo binds to the interface named by GLOO_SOCKET_IFNAME; unless the user chose one, it is the interface
    that holds this node's address (loopback for one-node jobs), so nothing listens on other networks."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # N workers sharing the cores; as torchrun does
    os.environ["LOOM_RUN_DIR"] = str(spec.run_dir.resolve())
    os.environ["PYTHONUNBUFFERED"] = "1"
    if spec.trace_steps:
        os.environ["LOOM_TRACE_STEPS"] = spec.trace_steps
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_of(local_addr) if sys.platform.startswith("linux") else None
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface


def _quiet_agent_logs() -> None:
    # The agent narrates every rendezvous at WARNING; loom prints its own summary of failures.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _describe_failures(error) -> str:
    """One line for the root cause (`root_failure`), one for the workers stopped because of it."""
    from loom.launch.elastic import failure_text, root_failure

    failures = error.failures
    root = root_failure(failures)
    failure = failures[root]
    lines = [f"loom run: worker rank {root} failed (exit code {failure.exitcode}): {failure_text(failure)}"]
    others = sorted(r for r in failures if r != root)
    if others:
        lines.append(f"loom run: stopped the other workers (ranks {others})")
    return "\n".join(lines)


def launch(spec: LaunchSpec) -> int:
    """Run the job to completion; returns the process exit status (0 on success)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from loom.fault.timeouts import hang_timeout_s, liveness_timeout_s
    from loom.launch.elastic import run_agent
    from loom.launch.rendezvous import LOST_AFTER_GRACE_S, LoomRendezvous, PeerLost
    from loom.net.store import StoreTimeout, StoreUnreachable

    try:
        secret = secret_of(spec)
        host, port, local_addr = endpoint_and_addr(spec)
        lost_after_s = min(liveness_timeout_s() + LOST_AFTER_GRACE_S, hang_timeout_s())
    except ValueError as error:
        return refuse(f"loom run: {error}")
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    _worker_env(spec, local_addr)
    _quiet_agent_logs()
    run_id, logs = run_id_of(spec), spec.run_dir / "logs"
    cannot_listen = f"loom run: node 0 cannot listen on the master address {host}:{port}"
    if spec.on_worker_failure in ("continue", "heal"):
        try:
            status = _supervised(spec, run_id, host, port)
        except OSError as error:
            if spec.nnodes == 1:  # node 0's store across nodes: one node's listens on loopback
                raise
            return refuse(f"{cannot_listen}: {error.strerror or error}")
        if status:
            print(f"loom run: worker logs are in {logs}", file=sys.stderr)
        return status
    try:
        rendezvous = LoomRendezvous(spec, host, port, secret, run_id, local_addr, lost_after_s)
    except OSError as error:
        return refuse(f"{cannot_listen}: {error.strerror or error}. HINT: run node 0 on the host --master names, "
                      "with a port nothing else uses")  # fmt: skip
    started = time.monotonic()
    servers = None
    try:
        with _servers(spec) as servers:
            restarts = run_agent(spec, rendezvous, local_addr, _worker_args(spec))
    except ChildFailedError as error:
        print(_describe_failures(error), file=sys.stderr)
        lost = rendezvous.silent_peers()
        if lost:
            print(f"loom run: {lost}", file=sys.stderr)
        return refuse(f"loom run: worker logs are in {logs}", 1)
    except (PeerLost, StoreUnreachable, StoreTimeout) as error:
        return refuse(f"loom run: {error}", 1)
    except SignalException as stop:
        if servers is not None and servers.failure is not None:  # the server watcher stopped the job
            return refuse(f"loom run: workers were terminated; logs are in {logs}", 1)
        print(f"loom run: stopped by signal {stop.sigval.name}; workers were terminated", file=sys.stderr)
        return 128 + int(stop.sigval)
    finally:
        rendezvous.shutdown()  # idempotent; the agent calls it too, but not if it failed before starting
    print(summary_line(spec, time.monotonic() - started, restarts, servers.restarts), file=sys.stderr)
    return 0


@contextmanager
def _servers(spec: LaunchSpec, **options: Callable[[], None]) -> Iterator[ServerGroup]:
    """The job's parameter servers while it runs (`loom.launch.servers.ServerGroup`; none without ``--servers``;
    ``options``: its ``on_failure``), their addresses in ``LOOM_PS_ADDRS``; the workers' traces merged at its end."""
    from loom.launch.servers import ServerGroup

    try:
        group = ServerGroup(
            spec.servers, spec.server_bind, spec.max_server_restarts, spec.run_dir.resolve(), **options
        )
        try:
            if spec.servers:
                group.start()
                os.environ["LOOM_PS_ADDRS"] = ",".join(group.addresses)
            yield group
        finally:
            group.stop()
    finally:
        if spec.trace_steps:
            merge_traces_and_say(spec.run_dir, "loom run")


def summary_line(spec: LaunchSpec, seconds: float, restarts: int, server_restarts: int = 0) -> str:
    """The job's last line: time, workers, restarts (of parameter servers too, if any) and, when rank 0 kept
    step records, its last step."""
    workers = f"{spec.nproc} worker(s)" + (f" on each of {spec.nnodes} nodes" if spec.nnodes > 1 else "")
    restarts_text = f"{restarts} restart(s)" + (
        f", {server_restarts} parameter-server restart(s)" if server_restarts else ""
    )
    last = last_recorded_step(spec.run_dir / "metrics" / "rank0.jsonl")
    steps = f", {last} steps" if last is not None and spec.node_rank == 0 else ""
    return (
        f"loom run: finished in {seconds:.1f} s: {workers}, {restarts_text}{steps}; "
        f"logs and metrics in {spec.run_dir}"
    )


def last_recorded_step(path: Path, tail_bytes: int = 65536) -> int | None:
    """The ``step`` of the last complete record in a step-record file (its last ``tail_bytes`` read), or None."""
    import json

    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


def _worker_args(spec: LaunchSpec) -> list[str]:
    args = ["-u", "-m", "loom.launch.worker"]
    args += ["-m", spec.target] if spec.module else [str(Path(spec.target).resolve())]
    return args + list(spec.args)


def _supervised(spec: LaunchSpec, run_id: str, host: str, port: int) -> int:
    """``--on-worker-failure continue|heal``: the agent is not used; `loom.launch.supervise` runs the workers
    (`loom.launch.heal_nodes` under heal, one host being node 0 alone)."""
    from loom.launch.heal_nodes import heal_across_nodes
    from loom.launch.supervise import supervise_workers

    if spec.on_worker_failure == "heal" and spec.nnodes > 1:
        return heal_across_nodes(spec, run_id, host, port, _worker_args(spec))
    with _servers(spec, on_failure=lambda: None) as servers:
        if spec.on_worker_failure == "heal":  # node 0 alone, its store on loopback as supervise_workers' is
            return heal_across_nodes(spec, run_id, "127.0.0.1", 0, _worker_args(spec))
        return supervise_workers(spec.nproc, _worker_args(spec), run_id, spec.run_dir / "logs",
                                 spec.shutdown_timeout_s, lambda: servers.failure)  # fmt: skip
