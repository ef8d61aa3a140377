"""Start the worker processes of a job on PyTorch's elastic agent (the engine behind ``torchrun``).

The agent runs the rendezvous, starts ``nproc`` workers on this node, watches them, stops all of them when one
fails, and restarts the whole group up to ``max_restarts`` times. loom adds:

- a fresh rendezvous TCP store per attempt (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): reusing the agent's store
  across restarts made gloo restarts hang or fail intermittently on this machine;
- loopback addresses for one-node jobs, so nothing listens beyond this host unless multi-node flags ask for it;
- each output line prefixed with its rank, and the workers' logs kept under the run directory;
- a one-line failure message naming the failing rank and its error, instead of the agent's table.

Workers run `loom.launch.worker`, which runs the user's script and records its exception for the agent.

With ``on_worker_failure="continue"`` the agent is not used: `loom.launch.supervise` starts the workers itself and
lets the others finish when one dies (asynchronous parameter-server training); see that module for the exit status.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LaunchSpec", "launch", "free_port"]


@dataclass(frozen=True)
class LaunchSpec:
    """What `loom run` starts."""

    target: str
    """Path of the training script, or a module name when ``module`` is set."""
    args: tuple[str, ...] = ()
    """Arguments passed to the script."""
    nproc: int = 1
    """Worker processes on this node."""
    module: bool = False
    """Run ``target`` as a module (``python -m``)."""
    max_restarts: int = 0
    """Times the whole worker group is restarted after a failure."""
    nnodes: int = 1
    """Nodes (hosts) in the job; each runs ``loom run`` with its own ``node_rank``."""
    node_rank: int = 0
    master: str | None = None
    """``ADDR:PORT`` of node 0's rendezvous store; required with more than one node."""
    local_addr: str | None = None
    """Address other nodes reach this node at (defaults: loopback on one node, the master address on node 0)."""
    run_dir: Path = field(default_factory=lambda: Path("runs"))
    """Where logs and metrics of the job go."""
    shutdown_timeout_s: int = 5
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    servers: int = 0
    """Parameter-server processes to start beside the workers (one-node jobs only)."""
    server_bind: str = "127.0.0.1"
    """Address the parameter servers listen on (loopback unless asked)."""
    trace_steps: str | None = None
    """``A:B``: workers write a Chrome-trace timeline of steps A..B (handed over as ``LOOM_TRACE_STEPS``)."""
    on_worker_failure: str = "stop"
    """``stop``: a dead worker stops the group (restarted up to ``max_restarts`` times); ``continue``: the
    others go on (one node, no restarts; for ``ParameterServer(mode="async"|"ssp")``)."""

    def __post_init__(self) -> None:
        for name in ("nproc", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.master:
            raise ValueError("a multi-node job needs --master ADDR:PORT (node 0's address and a free port)")
        if self.master is not None:
            host, _, port = self.master.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--master must be ADDR:PORT, got {self.master!r}")
        if self.servers < 0:
            raise ValueError(f"--servers must be >= 0, got {self.servers}")
        if self.servers and self.nnodes > 1:
            raise ValueError(
                "--servers is supported on one-node jobs only (parameter servers start on this host)"
            )
        if self.on_worker_failure not in ("stop", "continue"):
            raise ValueError(f"--on-worker-failure {self.on_worker_failure!r}; use 'stop' or 'continue'")
        if self.on_worker_failure == "continue" and (self.max_restarts or self.nnodes > 1):
            raise ValueError(
                "--on-worker-failure continue runs one node without restarts; "
                f"got --max-restarts {self.max_restarts}, --nnodes {self.nnodes}. HINT: drop one of them"
            )
        if not self.module and not Path(self.target).is_file():
            raise FileNotFoundError(f"loom run: script {self.target!r} does not exist")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def route_address(host: str) -> str:
    """This host's address on the route to ``host`` (a UDP "connect" sends nothing, it only picks a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _endpoint_and_addr(spec: LaunchSpec) -> tuple[str, str]:
    """The rendezvous endpoint, and the address this node's workers are reached at by the others.

    Whichever node the rendezvous makes rank 0 hosts the workers' store at its address, so every node needs an
    address the others can reach: by default, its own address on the route to the master.
    """
    if spec.master is None:
        return f"127.0.0.1:{free_port()}", spec.local_addr or "127.0.0.1"
    master_host = spec.master.rpartition(":")[0]
    return spec.master, spec.local_addr or route_address(master_host)


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 ``address`` on this host (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _run_id(spec: LaunchSpec) -> str:
    """The rendezvous key: every node of a job must use the same one, so multi-node jobs derive it from the
    master endpoint (each job's store is new, hosted by node 0's agent); ``LOOM_RUN_ID`` overrides it."""
    if "LOOM_RUN_ID" in os.environ:
        return os.environ["LOOM_RUN_ID"]
    if spec.master is not None:
        return "loom-" + spec.master.replace(":", "-")
    return uuid.uuid4().hex[:12]


def _worker_env(spec: LaunchSpec, local_addr: str) -> None:
    """Environment every worker inherits (the agent copies this process's environment).

    gloo binds to the interface named by GLOO_SOCKET_IFNAME; unless the user chose one, it is the interface
    that holds this node's address (loopback for one-node jobs), so nothing listens on other networks."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # N workers sharing the cores; as torchrun does
    os.environ["LOOM_RUN_DIR"] = str(spec.run_dir.resolve())
    os.environ["PYTHONUNBUFFERED"] = "1"
    if spec.trace_steps:
        os.environ["LOOM_TRACE_STEPS"] = spec.trace_steps
    # The job secret authenticates loom's own sockets (parameter servers, ...); every node must share it, so a
    # multi-node job takes it from the environment the user gives all nodes.
    os.environ.setdefault("LOOM_JOB_SECRET", secrets.token_hex(32))
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_of(local_addr) if sys.platform.startswith("linux") else None
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface


def _quiet_agent_logs() -> None:
    # The agent narrates every rendezvous at WARNING; loom prints its own summary of failures.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _failure_text(failure) -> str:
    message = failure.message
    if isinstance(message, dict):  # an error file written by the worker: {"message": "...", "extraInfo": ...}
        message = message.get("message", "")
    message = str(message or "").strip()
    if failure.exitcode is not None and failure.exitcode < 0:
        return message or f"killed by signal {-failure.exitcode}"
    return message.splitlines()[-1] if message else "exited without a Python exception"


def _describe_failures(error) -> str:
    """One line for the root cause: the worker that raised, else one not stopped by the agent's SIGTERM."""
    failures = error.failures

    def blame(rank: int) -> tuple[int, int, int]:
        f = failures[rank]
        raised = isinstance(f.message, dict) or f.error_file_data.get("message") is not None
        stopped_by_agent = f.exitcode == -15
        return (0 if raised else 1, 1 if stopped_by_agent else 0, f.timestamp)

    root = min(failures, key=blame)
    failure = failures[root]
    lines = [f"loom run: worker rank {root} failed (exit code {failure.exitcode}): {_failure_text(failure)}"]
    others = sorted(r for r in failures if r != root)
    if others:
        lines.append(f"loom run: stopped the other workers (ranks {others})")
    return "\n".join(lines)


def launch(spec: LaunchSpec) -> int:
    """Run the job to completion; returns the process exit status (0 on success)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    from loom.launch.servers import server_processes

    spec.run_dir.mkdir(parents=True, exist_ok=True)
    endpoint, local_addr = _endpoint_and_addr(spec)
    _worker_env(spec, local_addr)
    _quiet_agent_logs()
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=_run_id(spec),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": spec.node_rank == 0, "join_timeout": 300},
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(spec.run_dir / "logs"), tee=Std.ALL),
        log_line_prefix_template="[rank${rank}]: ",
        local_addr=local_addr,
        shutdown_timeout=spec.shutdown_timeout_s,
    )
    worker_args = ["-u", "-m", "loom.launch.worker"]
    worker_args += ["-m", spec.target] if spec.module else [str(Path(spec.target).resolve())]
    worker_args += list(spec.args)
    try:
        with server_processes(spec.servers, spec.server_bind) as server_addresses:
            if server_addresses:
                os.environ["LOOM_PS_ADDRS"] = ",".join(server_addresses)
            if spec.on_worker_failure == "continue":
                from loom.launch.supervise import supervise_workers

                logs = spec.run_dir / "logs"
                status = supervise_workers(
                    spec.nproc, worker_args, config.run_id, logs, spec.shutdown_timeout_s
                )
                if status:
                    print(f"loom run: worker logs are in {logs}", file=sys.stderr)
                return status
            launch_agent(config, sys.executable, worker_args)
    except ChildFailedError as error:
        print(_describe_failures(error), file=sys.stderr)
        print(f"loom run: worker logs are in {spec.run_dir / 'logs'}", file=sys.stderr)
        return 1
    except SignalException as stop:
        print(f"loom run: stopped by signal {stop.sigval.name}; workers were terminated", file=sys.stderr)
        return 128 + int(stop.sigval)
    finally:
        if spec.trace_steps:
            _merge_traces(spec.run_dir)
    return 0


def _merge_traces(run_dir: Path) -> None:
    """Combine the workers' per-rank traces into ``RUN_DIR/trace.json`` (Perfetto / chrome://tracing)."""
    from loom.observe.trace import merge_traces

    try:
        merged = merge_traces(run_dir)
    except (OSError, ValueError) as error:
        print(f"loom run: could not merge the trace files: {error}", file=sys.stderr)
        return
    if merged is not None:
        print(f"loom run: timeline written to {merged}", file=sys.stderr)
