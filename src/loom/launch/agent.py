"""Start a job's worker processes on this node and say how it ended: `launch`, which ``loom run`` (and
``--cluster``, `loom.launch.cluster`) calls once the options are checked (`loom.launch.spec`).

One supervisor, three policies: ``stop`` (the default; the group restarted up to ``--max-restarts`` times, one
node or many: `loom.launch.restarts`), ``continue`` (`loom.launch.supervise`) and ``heal``
(`loom.launch.heal_nodes`). Each starts `loom.launch.worker` with torchrun's environment, forked by the zygote,
its output prefixed with its rank and logged under the run directory; each node meets the others in loom's
authenticated store (loopback for one-node jobs; a multi-node job's listens on the master address only and needs
``LOOM_JOB_SECRET`` unless ``insecure_no_secret``). User-facing: docs/launching.md.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from loom.errors import GroupFailed, PeerLost
from loom.launch.bounds import refuse
from loom.launch.spec import LaunchSpec, endpoint_and_addr, run_id_of, secret_of
from loom.net.interfaces import interface_of
from loom.observe.report import record_files
from loom.observe.trace import merge_traces_and_say

if TYPE_CHECKING:
    from loom.launch.servers import ServerGroup

__all__ = ["launch"]


def _worker_env(spec: LaunchSpec, local_addr: str) -> None:
    """Environment every worker inherits (each starts with this process's environment).

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


def launch(spec: LaunchSpec) -> int:
    """Run the job to completion; returns the process exit status (0 on success)."""
    from loom.fault.timeouts import hang_timeout_s, liveness_timeout_s
    from loom.launch.restarts import LOST_AFTER_GRACE_S, Rounds, run_group
    from loom.launch.supervise import LauncherStopped, stopped_by_signals
    from loom.launch.zygote import Zygote
    from loom.net.store import StoreTimeout, StoreUnreachable

    try:
        secret = secret_of(spec)
        host, port, local_addr = endpoint_and_addr(spec)
        lost_after_s = min(liveness_timeout_s() + LOST_AFTER_GRACE_S, hang_timeout_s())
    except ValueError as error:
        return refuse(f"loom run: {error}")
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    _worker_env(spec, local_addr)
    run_id = run_id_of(spec)
    cannot_listen = f"loom run: node 0 cannot listen on the master address {host}:{port}"
    if spec.on_worker_failure in ("continue", "heal"):
        try:
            return _supervised(spec, run_id, host, port)
        except OSError as error:
            if spec.nnodes == 1:  # node 0's store across nodes: one node's listens on loopback
                raise
            return refuse(f"{cannot_listen}: {error.strerror or error}")
    try:
        rounds = Rounds(spec, host, port, secret, run_id, local_addr, lost_after_s)
    except OSError as error:
        return refuse(f"{cannot_listen}: {error.strerror or error}. HINT: run node 0 on the host --master names, "
                      "with a port nothing else uses")  # fmt: skip
    started, args = time.monotonic(), _worker_args(spec)
    zygote = Zygote(args, {})
    servers = None
    try:
        with stopped_by_signals(), _servers(spec, on_failure=lambda: None) as servers:
            restarts = run_group(spec, rounds, args, zygote, lambda: servers.failure)
    except GroupFailed as failed:
        if servers is not None and servers.failure is not None:  # a parameter server stopped the job
            print("loom run: workers were terminated", file=sys.stderr)
        seconds, server_restarts = time.monotonic() - started, servers.restarts if servers is not None else 0
        return refuse(summary_line(spec, seconds, failed.args[0], server_restarts, failed=True), 1)
    except (PeerLost, StoreUnreachable, StoreTimeout) as error:
        return refuse(f"loom run: {error}", 1)
    except LauncherStopped as stop:
        print(f"loom run: stopped by signal {stop}; workers were terminated", file=sys.stderr)
        return 128 + stop.signum
    finally:
        zygote.close()
        rounds.close()
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


def summary_line(spec: LaunchSpec, seconds: float, restarts: int | None, server_restarts: int = 0,
                 failed: bool = False) -> str:  # fmt: skip
    """The job's last line, whether it finished or ``failed``: time, workers, restarts (heals under ``heal``; of
    parameter servers too, if any; None: unknown) and, when rank 0 (its latest generation) kept step records, its
    last step."""
    workers = f"{spec.nproc} worker(s)" + (f" on each of {spec.nnodes} nodes" if spec.nnodes > 1 else "")
    kind = "heal" if spec.on_worker_failure == "heal" else "restart"
    restarts_text = (f"{kind}s unknown" if restarts is None else f"{restarts} {kind}(s)") + (
        f", {server_restarts} parameter-server restart(s)" if server_restarts else ""
    )
    rank0 = [path for rank, _, path in record_files(spec.run_dir / "metrics") if rank == 0]
    last = last_recorded_step(rank0[-1]) if rank0 else None
    steps = f", {last} steps" if last is not None and spec.node_rank == 0 else ""
    return (
        f"loom run: {'failed after' if failed else 'finished in'} {seconds:.1f} s: {workers}, {restarts_text}{steps}; "
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
    """``--on-worker-failure continue|heal``: `loom.launch.supervise` runs the workers (`loom.launch.heal_nodes`
    under heal, one host being node 0 alone)."""
    from loom.launch.heal_nodes import heal_across_nodes
    from loom.launch.supervise import supervise_workers

    started, server_restarts = time.monotonic(), 0
    if spec.on_worker_failure == "heal" and spec.nnodes > 1:
        status, heals = heal_across_nodes(spec, run_id, host, port, _worker_args(spec))
    else:
        with _servers(spec, on_failure=lambda: None) as servers:
            # heal: node 0 alone, its store on loopback as supervise_workers' is
            if spec.on_worker_failure == "heal":
                status, heals = heal_across_nodes(spec, run_id, "127.0.0.1", 0, _worker_args(spec))
            else:
                status, heals = supervise_workers(spec.nproc, _worker_args(spec), run_id, spec.run_dir / "logs",
                                                  spec.shutdown_timeout_s, lambda: servers.failure), 0  # fmt: skip
        server_restarts = servers.restarts
    seconds = time.monotonic() - started
    if status in (0, 1):  # 2: refused before it started (its one line); a signal's stop is said where caught
        print(summary_line(spec, seconds, heals, server_restarts, failed=status != 0), file=sys.stderr)
    return status
