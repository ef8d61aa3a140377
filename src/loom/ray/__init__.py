"""loom on Ray: the same training script, placed, restarted and collected by a Ray cluster.

`run` runs a function that calls ``loom.init()`` as usual and returns one result per rank; `run_script` (``loom
run --backend ray``) runs a script. Usage and limits: docs/launching.md ("Ray"); how a job runs:
`loom.ray.backend`; the local Ray instance started when no ``address`` is given: `loom.ray.local`.

Why actors and a placement group, not Ray Train's ``TorchTrainer``: loom already does what Ray Train's Torch
backend adds (the process group and its environment, checkpoints that resume at any world size, the data order,
restarts from the latest checkpoint), the same way as under `loom run`; core Ray gives what loom needs
(placement, actors, failure detection), with a lighter extra (``ray``, not ``ray[train]``) and the script
unchanged.

Security: every rank proves ``LOOM_JOB_SECRET`` (fresh per job, passed inside Ray's channel, never printed) to
loom's store before anything is decoded, as under `loom run`. ``run``'s function and return value travel by
cloudpickle, between processes of the job only (`loom.ray.function`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.config_docs import document_options
from loom.errors import RayJobFailed, check_choice, check_int  # noqa: F401 - raised by run(), defined there

__all__ = ["RayConfig", "RayJobFailed", "run", "run_script"]

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayConfig:
    """Where and how a loom job runs on Ray."""

    num_workers: int = 1
    """Worker processes (ranks) of the job, each held by one Ray actor."""
    resources_per_worker: dict[str, float] | None = None
    """Ray resources each worker reserves in the job's placement group, e.g. ``{"CPU": 4, "GPU": 1}``
    (None: ``{"CPU": 1}``)."""
    placement_strategy: str = "PACK"
    """How the placement group spreads the workers over nodes: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."""
    max_failures: int = 0
    """Times the worker group is replaced after a worker process or its actor dies; each new group resumes
    from ``loom.fit``'s latest checkpoint (the script's ``checkpoint_dir``)."""
    servers: int = 0
    """Parameter servers for ``ParameterServer`` (``LOOM_PS_ADDRS``): one actor each, kept across restarts."""
    resources_per_server: dict[str, float] | None = None
    """Ray resources each parameter-server actor reserves, outside the workers' placement group (None:
    ``{"CPU": 0}``, no reservation)."""
    address: str | None = None
    """The Ray cluster (``auto``, ``HOST:PORT``). None: a local instance started for the job and stopped after
    it (or the cluster this process is connected to already)."""
    num_cpus: int | None = None
    """CPUs of a local instance (None: all of this machine's)."""
    run_dir: Path | None = None
    """Where logs, step records and traces are collected (`loom run`'s layout; ``loom report`` reads it);
    None: ``runs/<timestamp>``."""
    working_dir: str | None = None
    """Working directory of every rank (None: the driver's); it must exist at this path on every node."""
    copy_run_dir: bool | None = None
    """None: ranks on the driver's node write into ``run_dir``, the others write on their node and the driver
    copies their files in; True: copy for every rank; False: every node sees ``run_dir`` (shared storage)."""
    trace_steps: str | None = None
    """``A:B``: ranks record a Chrome-trace timeline of steps A..B, merged into ``run_dir/trace.json``."""
    start_timeout_s: float = 120.0
    """How long Ray may take to place the workers (and to answer any call) before the job fails."""
    grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when the driver stops a process."""
    poll_interval_s: float = 0.1
    """Pause between two polls of the ranks (output, files, exit status)."""

    def __post_init__(self) -> None:
        defaults = {
            "resources_per_worker": {"CPU": 1.0},
            "resources_per_server": {"CPU": 0.0},
            "run_dir": Path("runs") / time.strftime("%Y%m%d-%H%M%S"),
        }
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name, least in (("num_workers", 1), ("max_failures", 0), ("servers", 0)):
            check_int(name, getattr(self, name), least)
        check_choice("placement_strategy", self.placement_strategy, _STRATEGIES)
        for name in ("resources_per_worker", "resources_per_server"):
            resources = getattr(self, name)
            if not isinstance(resources, dict) or any(
                not isinstance(v, int | float) or isinstance(v, bool) or v < 0 for v in resources.values()
            ):
                raise ValueError(f"{name} must map resource names to amounts >= 0, got {resources!r}")
        if not any(v > 0 for v in (self.resources_per_worker or {}).values()):
            raise ValueError(
                f"resources_per_worker needs a positive amount (a placement-group bundle cannot be empty), got "
                f"{self.resources_per_worker!r}. HINT: {{'CPU': 1}}"
            )
        for name in ("start_timeout_s", "grace_s", "poll_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")


document_options(RayConfig, RayConfig)


def run(
    train_fn: Callable[..., Any],
    num_workers: int = 1,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    resources_per_worker: dict[str, float] | None = None,
    max_failures: int = 0,
    **options: Any,
) -> list[Any]:
    """Run ``train_fn(*args, **kwargs)`` on ``num_workers`` ranks placed by Ray; returns each rank's result.

    ``train_fn`` runs in a fresh process per rank and attempt, with loom's environment, so ``loom.init()``
    joins the job; ``options`` are further `RayConfig` fields (``servers``, ``address``, ``run_dir``...).
    Raises `RayJobFailed` naming the failed rank when the job fails after ``max_failures`` replacements."""
    from ray import cloudpickle

    from loom.ray.backend import WorkerSpec, run_job

    config = RayConfig(
        num_workers=num_workers,
        resources_per_worker=dict(resources_per_worker or {"CPU": 1.0}),
        max_failures=max_failures,
        **options,
    )
    payload = cloudpickle.dumps((train_fn, tuple(args), dict(kwargs or {})))
    argv = ["-u", "-m", "loom.ray.rank_main", "-m", "loom.ray.function"]
    results = run_job(config, WorkerSpec(argv, payload))
    missing = [rank for rank in sorted(results) if results[rank] is None]
    if missing:
        raise RayJobFailed(f"ranks {missing} ended without returning their result")
    return [cloudpickle.loads(results[rank]) for rank in sorted(results)]  # type: ignore[arg-type]


def run_script(target: str, args: Sequence[str] = (), *, module: bool = False, config: RayConfig) -> None:
    """Run a training script (or ``python -m`` module) on Ray as `loom run` runs it; raises `RayJobFailed`."""
    from loom.ray.backend import WorkerSpec, run_job

    if not module and not Path(target).is_file():
        raise FileNotFoundError(f"script {target!r} does not exist")
    entry = ["-m", target] if module else [str(Path(target).resolve())]
    run_job(config, WorkerSpec(["-u", "-m", "loom.ray.rank_main", *entry, *args]))


_LOCAL_ONLY = {
    "nnodes": 1, "node_rank": 0, "master": None, "local_addr": None, "on_worker_failure": "stop",
    "server_bind": "127.0.0.1", "join_timeout": 120.0, "insecure_no_secret": False, "cluster": None,
    "host_index": None,
}  # fmt: skip
"""`loom run` options that mean nothing on Ray (Ray places the workers), with their defaults."""


def run_from_cli(ns: argparse.Namespace, run_dir: Path) -> int:
    """``loom run --backend ray``: the parsed `loom run` options as a job; returns the exit status."""
    given = [name for name, default in _LOCAL_ONLY.items() if getattr(ns, name, default) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        print(f"loom run: {flags} do not apply to --backend ray (Ray places the workers and the servers). "
              "HINT: drop them, or use --address to choose the cluster", file=sys.stderr)  # fmt: skip
        return 2
    try:
        if ns.address is None:  # a local instance: all on this host, bounded as loom run's
            from loom.launch.bounds import check_nproc

            check_nproc(ns.nproc, getattr(ns, "max_nproc", None))
            check_nproc(ns.servers, getattr(ns, "max_nproc", None), "--servers")
        config = RayConfig(
            num_workers=ns.nproc,
            max_failures=ns.max_restarts,
            servers=ns.servers,
            address=ns.address,
            run_dir=run_dir,
            trace_steps=ns.trace_steps,
        )
        run_script(ns.script, ns.args, module=ns.module, config=config)
    except (ValueError, FileNotFoundError) as error:
        print(f"loom run: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # RayJobFailed, and Ray's own errors reaching the cluster
        print(f"loom run: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("loom run: interrupted; the job's processes were stopped", file=sys.stderr)
        return 130
    return 0
