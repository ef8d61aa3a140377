"""Start the worker processes of a job on PyTorch's elastic agent (the engine behind ``torchrun``).

The agent starts ``nproc`` workers on this node, watches them, stops all of them when one fails, and restarts the
whole group up to ``max_restarts`` times. loom adds:

- its own rendezvous (`loom.launch.rendezvous`) in its own store (`loom.net.store`) instead of the agent's
  ``c10d`` one: every peer proves the job secret before it reads or writes a key, nothing is unpickled, every
  call is bounded, and each attempt is a fresh round of keys;
- loopback addresses for one-node jobs, so nothing listens beyond this host unless multi-node flags ask for it;
  a multi-node job's store listens on the master address only, and needs ``LOOM_JOB_SECRET`` (the same on every
  node) unless ``insecure_no_secret`` says otherwise;
- each output line prefixed with its rank, and the workers' logs kept under the run directory;
- a one-line failure message naming the failing rank and its error, instead of the agent's table, and a line
  naming a node this one lost contact with.

Workers run `loom.launch.worker`, which runs the user's script and records its exception for the agent.

With ``on_worker_failure="continue"`` the agent is not used: `loom.launch.supervise` starts the workers itself and
lets the others finish when one dies (asynchronous parameter-server training); see that module for the exit status.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from loom.launch.bounds import check_nproc
from loom.net.interfaces import interface_of

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
    max_server_restarts: int = 3
    """Times each parameter server that dies while the job runs is restarted from its checkpoint; once more
    stops the job (`loom.launch.servers`)."""
    server_bind: str = "127.0.0.1"
    """Address the parameter servers listen on (loopback unless asked)."""
    trace_steps: str | None = None
    """``A:B``: workers write a Chrome-trace timeline of steps A..B (handed over as ``LOOM_TRACE_STEPS``)."""
    on_worker_failure: str = "stop"
    """``stop``: a dead worker stops the group (restarted up to ``max_restarts`` times); ``continue``: the
    others go on (one node, no restarts; for ``ParameterServer(mode="async"|"ssp")``)."""
    max_heals: int = 3
    """``heal``: replacements the job may start in all (`loom.launch.heal`)."""
    min_workers: int = 1
    """``heal``: members below which the job stops, naming the lost ranks."""
    join_timeout_s: float = 120.0
    """How long a node waits for the master to answer and for every node to join (each attempt)."""
    insecure_no_secret: bool = False
    """Let a multi-node job run without ``LOOM_JOB_SECRET`` (a fixed, public key: anyone who can reach the
    master can join or disturb the job; nothing is unpickled either way)."""
    max_nproc: int | None = None
    """Most worker processes this node may start (None: `loom.launch.bounds.default_max_nproc`, 8 per core)."""

    def __post_init__(self) -> None:
        for name in ("nproc", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_nproc(self.nproc, self.max_nproc)
        if self.servers > 0:
            check_nproc(self.servers, self.max_nproc, "--servers")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.master:
            raise ValueError("a multi-node job needs --master ADDR:PORT (node 0's address and a free port)")
        if self.master is not None:
            master_host_port(self.master)
        if not self.join_timeout_s > 0:
            raise ValueError(f"--join-timeout must be > 0 seconds, got {self.join_timeout_s}")
        if self.servers < 0:
            raise ValueError(f"--servers must be >= 0, got {self.servers}")
        if self.max_server_restarts < 0:
            raise ValueError(f"--max-server-restarts must be >= 0, got {self.max_server_restarts}")
        if self.servers and self.nnodes > 1:
            raise ValueError(
                "--servers is supported on one-node jobs only (parameter servers start on this host)"
            )
        if self.on_worker_failure not in ("stop", "continue", "heal"):
            raise ValueError(
                f"--on-worker-failure {self.on_worker_failure!r}; use 'stop', 'continue' or 'heal'"
            )
        if self.on_worker_failure == "heal" and not 1 <= self.min_workers <= self.nproc:
            raise ValueError(f"--min-workers {self.min_workers} must be in 1..{self.nproc} (-n)")
        if self.max_heals < 0:
            raise ValueError(f"--max-heals must be >= 0, got {self.max_heals}")
        if self.on_worker_failure in ("continue", "heal") and (self.max_restarts or self.nnodes > 1):
            raise ValueError(
                f"--on-worker-failure {self.on_worker_failure} runs one node without restarts; "
                f"got --max-restarts {self.max_restarts}, --nnodes {self.nnodes}. HINT: drop one of them"
            )
        if not self.module and Path(self.target).is_dir():
            raise FileNotFoundError(
                f"script {self.target!r} is a directory. HINT: give the training script's path"
            )
        if not self.module and not Path(self.target).is_file():
            raise FileNotFoundError(f"script {self.target!r} does not exist")


def master_host_port(master: str) -> tuple[str, int]:
    """``ADDR:PORT`` checked: a port in 1..65535 and a host that resolves to an IPv4 address (returned)."""
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--master must be ADDR:PORT (node 0's address and a free port), got {master!r}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"--master port must be in 1..65535, got {port} in {master!r}")
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        reason = error.strerror if isinstance(error, socket.gaierror) else str(error)
        raise ValueError(
            f"--master host {host!r} does not resolve to an IPv4 address ({reason}). "
            "HINT: give node 0's IP address or a name this host can resolve"
        ) from None
    return str(infos[0][4][0]), int(port)


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


def _endpoint_and_addr(spec: LaunchSpec) -> tuple[str, int, str]:
    """The store's host and port (port 0: node 0 of a one-node job lets the OS pick), and the address this
    node's workers are reached at by the others: by default, its own address on the route to the master."""
    if spec.master is None:
        return "127.0.0.1", 0, spec.local_addr or "127.0.0.1"
    host, port = master_host_port(spec.master)
    try:
        return host, port, spec.local_addr or route_address(host)
    except OSError as error:
        raise ValueError(
            f"no route from this host to the master {spec.master}: {error.strerror or error}"
        ) from None


def _secret(spec: LaunchSpec) -> bytes:
    """The job secret, put in ``LOOM_JOB_SECRET`` for the workers: the user's (multi-node: required, the same on
    every node), else a fresh one (one node), else a public one (``insecure_no_secret``)."""
    from loom.net.store import job_secret

    if os.environ.get("LOOM_JOB_SECRET"):
        return job_secret()
    if spec.nnodes > 1:
        if not spec.insecure_no_secret:
            raise ValueError(
                "a multi-node job needs LOOM_JOB_SECRET, the same on every node: it authenticates every "
                "connection to the job's store. HINT: export LOOM_JOB_SECRET=$(openssl rand -hex 32) and pass "
                "it to every node, or --insecure-no-secret on a network you trust"
            )
        print("loom run: warning: --insecure-no-secret: anyone who can reach the master can join this job",
              file=sys.stderr)  # fmt: skip
        os.environ["LOOM_JOB_SECRET"] = hashlib.sha256(
            b"loom insecure " + str(spec.master).encode()
        ).hexdigest()
    else:
        os.environ["LOOM_JOB_SECRET"] = secrets.token_hex(32)
    return job_secret()


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
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from loom.fault.liveness import liveness_timeout_s
    from loom.fault.watchdog import hang_timeout_s
    from loom.launch.elastic import AgentOptions, run_agent
    from loom.launch.rendezvous import LOST_AFTER_GRACE_S, LoomRendezvous, PeerLost
    from loom.launch.servers import server_processes
    from loom.net.store import StoreTimeout, StoreUnreachable

    try:
        secret = _secret(spec)
        host, port, local_addr = _endpoint_and_addr(spec)
        lost_after_s = min(liveness_timeout_s() + LOST_AFTER_GRACE_S, hang_timeout_s())
    except ValueError as error:
        print(f"loom run: {error}", file=sys.stderr)
        return 2
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    _worker_env(spec, local_addr)
    _quiet_agent_logs()
    run_id = _run_id(spec)
    if spec.on_worker_failure in ("continue", "heal"):
        return _supervised(spec, run_id)
    try:
        rendezvous = LoomRendezvous(
            spec.node_rank,
            spec.nnodes,
            host,
            port,
            secret,
            run_id,
            local_addr,
            spec.join_timeout_s,
            lost_after_s,
        )
    except OSError as error:
        print(f"loom run: node 0 cannot listen on the master address {host}:{port}: {error.strerror or error}. "
              "HINT: run node 0 on the host --master names, with a port nothing else uses", file=sys.stderr)  # fmt: skip
        return 2
    options = AgentOptions(
        nproc=spec.nproc,
        max_restarts=spec.max_restarts,
        logs_specs=DefaultLogsSpecs(log_dir=str(spec.run_dir / "logs"), tee=Std.ALL),
        local_addr=local_addr,
        shutdown_timeout_s=spec.shutdown_timeout_s,
    )
    started = time.monotonic()
    servers = None
    try:
        with server_processes(
            spec.servers, spec.server_bind, spec.max_server_restarts, spec.run_dir.resolve()
        ) as servers:
            if servers.addresses:
                os.environ["LOOM_PS_ADDRS"] = ",".join(servers.addresses)
            _, restarts = run_agent(options, rendezvous, sys.executable, _worker_args(spec))
    except ChildFailedError as error:
        print(_describe_failures(error), file=sys.stderr)
        lost = rendezvous.silent_peers()
        if lost:
            print(f"loom run: {lost}", file=sys.stderr)
        print(f"loom run: worker logs are in {spec.run_dir / 'logs'}", file=sys.stderr)
        return 1
    except (PeerLost, StoreUnreachable, StoreTimeout) as error:
        print(f"loom run: {error}", file=sys.stderr)
        return 1
    except SignalException as stop:
        if servers is not None and servers.failure is not None:  # the server watcher stopped the job
            print(f"loom run: workers were terminated; logs are in {spec.run_dir / 'logs'}", file=sys.stderr)
            return 1
        print(f"loom run: stopped by signal {stop.sigval.name}; workers were terminated", file=sys.stderr)
        return 128 + int(stop.sigval)
    finally:
        rendezvous.shutdown()  # idempotent; the agent calls it too, but not if it failed before starting
        if spec.trace_steps:
            _merge_traces(spec.run_dir)
    server_restarts = servers.restarts if servers is not None else 0
    print(summary_line(spec, time.monotonic() - started, restarts, server_restarts), file=sys.stderr)
    return 0


def summary_line(spec: LaunchSpec, seconds: float, restarts: int, server_restarts: int = 0) -> str:
    """The job's last line: time, workers, restarts (of parameter servers too, if any) and, when rank 0 kept
    step records, its last step."""
    workers = f"{spec.nproc} worker(s)" + (f" on each of {spec.nnodes} nodes" if spec.nnodes > 1 else "")
    if server_restarts:
        restarts_text = f"{restarts} restart(s), {server_restarts} parameter-server restart(s)"
    else:
        restarts_text = f"{restarts} restart(s)"
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


def _supervised(spec: LaunchSpec, run_id: str) -> int:
    """``--on-worker-failure continue|heal``: `loom.launch.supervise` runs the workers, not the agent."""
    from loom.launch.servers import server_processes
    from loom.launch.supervise import supervise_workers

    logs = spec.run_dir / "logs"
    try:
        with server_processes(
            spec.servers, spec.server_bind, spec.max_server_restarts, spec.run_dir.resolve(), lambda: None
        ) as servers:
            if servers.addresses:
                os.environ["LOOM_PS_ADDRS"] = ",".join(servers.addresses)
            heal = None
            if spec.on_worker_failure == "heal":
                from loom.launch.heal import HealPolicy

                heal = HealPolicy(spec.max_heals, spec.min_workers)
            status = supervise_workers(
                spec.nproc,
                _worker_args(spec),
                run_id,
                logs,
                spec.shutdown_timeout_s,
                lambda: servers.failure,
                heal,
            )
    finally:
        if spec.trace_steps:
            _merge_traces(spec.run_dir)
    if status:
        print(f"loom run: worker logs are in {logs}", file=sys.stderr)
    return status


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
