"""What ``loom run`` starts, checked before anything starts: `LaunchSpec` (the options, each validated with the
value and the fix), and the job's identity derived from it on each node: the store's address
(`endpoint_and_addr`), the job secret (`secret_of`) and the rendezvous key (`run_id_of`).

Kept apart from running the job (`loom.launch.agent`, `loom.launch.supervise`, `loom.launch.heal_nodes`) so the
checks can be read, and tested, without the machinery that starts processes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from loom.errors import check_choice, check_int
from loom.launch.bounds import check_nproc
from loom.net.interfaces import route_address

__all__ = ["LaunchSpec", "endpoint_and_addr", "free_port", "master_host_port", "run_id_of",
           "secret_of"]  # fmt: skip


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
    others go on (one node, no restarts: asynchronous training); ``heal``: a replacement joins them."""
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
            check_int(name, getattr(self, name))
        check_nproc(self.nproc, self.max_nproc)
        if self.servers > 0:
            check_nproc(self.servers, self.max_nproc, "--servers")
        for flag in ("max_restarts", "servers", "max_server_restarts", "max_heals"):
            check_int(f"--{flag.replace('_', '-')}", getattr(self, flag), 0)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.master:
            raise ValueError("a multi-node job needs --master ADDR:PORT (node 0's address and a free port)")
        if self.master is not None:
            master_host_port(self.master)
        if not self.join_timeout_s > 0:
            raise ValueError(f"--join-timeout must be > 0 seconds, got {self.join_timeout_s}")
        if self.servers and self.nnodes > 1:
            raise ValueError(
                "--servers is supported on one-node jobs only (parameter servers start on this host)"
            )
        check_choice("--on-worker-failure", self.on_worker_failure, ("stop", "continue", "heal"))
        if self.on_worker_failure == "heal" and self.nnodes == 1 and not 1 <= self.min_workers <= self.nproc:
            raise ValueError(f"--min-workers {self.min_workers} must be in 1..{self.nproc} (-n). HINT: give "
                             f"--min-workers at most {self.nproc}, or start more workers with -n")  # fmt: skip
        check_int("--min-workers", self.min_workers)  # several nodes: also checked once all joined
        got = [f"{flag} {value}" for flag, value, default in (("--max-restarts", self.max_restarts, 0),
               ("--nnodes", self.nnodes, 1)) if value != default]  # fmt: skip
        if self.on_worker_failure == "continue" and got:
            raise ValueError(f"--on-worker-failure continue runs one node without restarts; got {', '.join(got)}. "
                             "HINT: leave it out, or use --on-worker-failure stop or heal")  # fmt: skip
        if self.on_worker_failure == "heal" and self.max_restarts:
            raise ValueError(
                f"--on-worker-failure heal replaces lost workers instead of restarting the group; got "
                f"--max-restarts {self.max_restarts}. HINT: drop --max-restarts (--max-heals is heal's budget)"
            )
        _check_heal_options(self)
        if not self.module and Path(self.target).is_dir():
            raise FileNotFoundError(
                f"script {self.target!r} is a directory. HINT: give the training script's path"
            )
        if not self.module and not Path(self.target).is_file():
            raise FileNotFoundError(f"script {self.target!r} does not exist (working directory {os.getcwd()}). "
                                    "HINT: check the path and the directory you run in, or add -m for a module")  # fmt: skip


def _check_heal_options(spec: LaunchSpec) -> None:
    """Heal's options that would be ignored or could never work, refused before anything starts: ``heal`` with
    one worker (a replacement copies a live member's state, and none is left), ``--max-heals``/``--min-workers``
    without ``heal``, and a malformed ``LOOM_FAULTS`` or one naming a rank the job does not have."""
    heal = spec.on_worker_failure == "heal"
    if heal and spec.nnodes == 1 and spec.nproc == 1:
        raise ValueError(
            "--on-worker-failure heal with -n 1: a replacement copies its state from a live worker, and with one "
            "worker none is left when it dies. HINT: run 2 or more workers (-n 2), or restart a single worker "
            "from loom.fit's checkpoints with --max-restarts N"
        )
    given = [f"{flag} {value}" for flag, value, default in (("--max-heals", spec.max_heals, 3),
             ("--min-workers", spec.min_workers, 1)) if value != default]  # fmt: skip
    if given and not heal:
        raise ValueError(
            f"{' and '.join(given)}: heal's options, which only --on-worker-failure heal uses (got --on-worker-failure "
            f"{spec.on_worker_failure}). HINT: add --on-worker-failure heal, or drop them"
        )
    faults = os.environ.get("LOOM_FAULTS", "")
    if faults.strip():
        from loom.fault.inject import parse_faults  # (no torch)

        outside = sorted({f.rank for f in parse_faults(faults) if spec.nnodes == 1 and f.rank >= spec.nproc})
        if outside:
            raise ValueError(
                f"LOOM_FAULTS={faults!r} names rank(s) {outside}, but the job's ranks are 0..{spec.nproc - 1}: "
                "those faults would never fire. HINT: name ranks below -n"
            )


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


def endpoint_and_addr(spec: LaunchSpec) -> tuple[str, int, str]:
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


def secret_of(spec: LaunchSpec) -> bytes:
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


def run_id_of(spec: LaunchSpec) -> str:
    """The rendezvous key: every node of a job must use the same one, so multi-node jobs derive it from the
    master endpoint (each job's store is new, hosted by node 0's agent); ``LOOM_RUN_ID`` overrides it."""
    if "LOOM_RUN_ID" in os.environ:
        return os.environ["LOOM_RUN_ID"]
    if spec.master is not None:
        return "loom-" + spec.master.replace(":", "-")
    return uuid.uuid4().hex[:12]
