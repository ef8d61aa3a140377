"""The driver of a loom job on Ray: place the workers, hand each loom's environment, watch, replace, collect.

One attempt: Ray places ``num_workers`` `loom.ray.rank_host.RankHost` actors in the job's placement group (one
bundle of ``resources_per_worker`` each, reserved once for the whole job), ranked by `loom.ray.layout.rank_layout`.
Each actor starts its rank's process with the environment `loom run` gives a worker plus the driver's
`_FORWARDED` variables; ``loom.init()`` joins loom's authenticated store (`loom.net.store`), hosted in the driver
at its Ray address, under a fresh key prefix per attempt. The driver polls every actor, prints each output line
prefixed with its rank, writes the copied files into the run directory (`loom run`'s layout, which ``loom
report`` reads), and stops at the first failure: a process that exits non-zero or is killed, or an actor that dies.

After a failure the whole group is stopped (a synchronous collective in flight fails on every rank) and, up to
``max_failures`` times, replaced by new actors; ``loom.fit(..., checkpoint_dir=...)`` resumes from its latest
checkpoint, as under ``loom run --max-restarts``. Parameter servers are actors too, started once and kept across
restarts.

Limits: the script, its working directory and any ``checkpoint_dir`` must be at the same path on every node
(a shared filesystem); a lost parameter server fails the job.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.errors import RayJobFailed
from loom.launch.supervise import exit_text
from loom.ray.layout import rank_layout
from loom.ray.output import blame, prefix_print, write_chunk

__all__ = ["WorkerSpec", "run_job"]

_FORWARDED = ("LOOM_", "GLOO_", "NCCL_", "TORCH_", "OMP_", "MKL_", "PYTHONPATH")
"""The driver's variables every process gets, as `loom run`'s workers inherit the launcher's environment."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank runs: ``python ARGV`` (`loom.ray.rank_main`, then the target), ``payload`` on stdin."""

    argv: list[str]
    payload: bytes | None = None


@dataclass
class _Rank:
    name: str
    actor: Any
    where: dict[str, Any]
    place: dict[str, Any] = field(default_factory=dict)
    """A worker's `rank_layout` entry: its local rank and size, node index and visible GPUs."""
    done: bool = False
    result: bytes | None = None
    bases: dict[str, int] = field(default_factory=dict)
    """Where this process's copied files start in the run directory's (see `loom.ray.output.write_chunk`)."""

    @property
    def title(self) -> str:
        """How messages name it: ``worker rank 3``, ``parameter server 0``."""
        if self.name.startswith("server"):
            return f"parameter server {self.name.removeprefix('server')}"
        return f"worker rank {self.name.removeprefix('rank')}"


class _Job:
    def __init__(self, config, work: WorkerSpec) -> None:
        import ray
        from ray.util.placement_group import placement_group

        from loom.net.store import StoreServer, job_secret
        from loom.ray.rank_host import RankHost, ship_by_value

        self.ray, self.config, self.work = ray, config, work
        self.run_dir = Path(config.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = os.environ.get("LOOM_RUN_ID") or uuid.uuid4().hex[:12]
        self.secret = os.environ.get("LOOM_JOB_SECRET") or secrets.token_hex(32)
        self.address = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.store = StoreServer(self.address, 0, job_secret(self.secret))
        ship_by_value()  # the actors do not import loom (`loom.ray.rank_host`)
        self.host_class: Any = ray.remote(max_restarts=0)(RankHost)
        self.servers: list[_Rank] = []
        self.server_addresses: list[str] = []
        self.staged: list[tuple[str, str]] = []
        """(node, private directory) of every process that wrote into one (removed at the end: see `close`)."""
        bundles = [dict(config.resources_per_worker) for _ in range(config.num_workers)]
        self.group = placement_group(bundles, strategy=config.placement_strategy)

    # -- placement --------------------------------------------------------------------------------------------
    def _wait_placed(self) -> None:
        ready, _ = self.ray.wait([self.group.ready()], timeout=self.config.start_timeout_s)
        if not ready:
            raise RayJobFailed(
                f"Ray could not place {self.config.num_workers} workers with {self.config.resources_per_worker} "
                f"each within {self.config.start_timeout_s:g} s; the cluster has "
                f"{self.ray.available_resources()} free. HINT: lower num_workers or resources_per_worker, or "
                "add nodes"
            )

    def _actor_options(self, resources: dict[str, float]) -> dict[str, Any]:
        left = dict(resources)
        options: dict[str, Any] = {"num_cpus": left.pop("CPU", 0), "num_gpus": left.pop("GPU", 0)}
        if "memory" in left:
            options["memory"] = left.pop("memory")
        if left:
            options["resources"] = left
        return options

    def _place_workers(self) -> list[_Rank]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actors = []
        for bundle in range(self.config.num_workers):
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle)
            options = self._actor_options(self.config.resources_per_worker)
            actors.append(
                self.host_class.options(scheduling_strategy=strategy, **options).remote(f"w{bundle}")
            )
        wheres = self.ray.get([a.where.remote() for a in actors], timeout=self.config.start_timeout_s)
        return [
            _Rank(f"rank{r}", actors[place["bundle"]], wheres[place["bundle"]], place)
            for r, place in enumerate(rank_layout(wheres))
        ]

    # -- environment ------------------------------------------------------------------------------------------
    def _base_env(self, where: dict[str, Any]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED)}
        env.update(LOOM_JOB_SECRET=self.secret, PYTHONUNBUFFERED="1", TORCHELASTIC_RUN_ID=self.run_id)
        env.setdefault("OMP_NUM_THREADS", "1")  # N workers sharing the cores; as torchrun does
        env["LOOM_RAY_NODE_ADDRESS"] = where["address"]  # GLOO_SOCKET_IFNAME: see loom.ray.rank_main
        if self.config.trace_steps:
            env["LOOM_TRACE_STEPS"] = self.config.trace_steps
        return env

    def _rank_env(self, rank: int, r: _Rank, attempt: int, nodes: int) -> dict[str, str]:
        env = self._base_env(r.where)
        size = str(self.config.num_workers)
        env.update(
            RANK=str(rank), WORLD_SIZE=size, LOCAL_RANK=str(r.place["local_rank"]),
            LOCAL_WORLD_SIZE=str(r.place["local_size"]), GROUP_RANK=str(r.place["node_index"]),
            GROUP_WORLD_SIZE=str(nodes), ROLE_RANK=str(rank), ROLE_WORLD_SIZE=size, ROLE_NAME="default", MASTER_ADDR=self.address, MASTER_PORT=str(self.store.port),
            LOOM_STORE_PREFIX=f"loom/{self.run_id}/attempt{attempt}/job/",
            TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_MAX_RESTARTS=str(self.config.max_failures),
        )  # fmt: skip
        if self.server_addresses:
            env["LOOM_PS_ADDRS"] = ",".join(self.server_addresses)
        if r.place["visible_gpus"] is not None:  # every GPU Ray gave the workers of its node (`rank_layout`)
            env["CUDA_VISIBLE_DEVICES"] = r.place["visible_gpus"]
        return env

    def _start(self, r: _Rank, argv: list[str], env: dict[str, str], log_name: str, payload) -> Any:
        copy = self.config.copy_run_dir  # None: a process on the driver's node writes into run_dir itself
        direct = r.where["node_id"] == self.node_id if copy is None else not copy
        run_dir = str(self.run_dir) if direct else None
        cwd = self.config.working_dir or os.getcwd()
        return r.actor.start.remote(argv, env, cwd, run_dir, log_name, payload)

    def _started(self, procs: list[_Rank], starts: list[Any]) -> None:
        staged = self.ray.get(starts, timeout=self.config.start_timeout_s)
        self.staged += [(p.where["node_id"], d) for p, d in zip(procs, staged, strict=True) if d is not None]

    # -- parameter servers ------------------------------------------------------------------------------------
    def start_servers(self) -> None:
        count = self.config.servers
        if not count:
            return
        options = self._actor_options(self.config.resources_per_server)
        actors = [self.host_class.options(**options).remote(f"server{i}") for i in range(count)]
        wheres = self.ray.get([a.where.remote() for a in actors], timeout=self.config.start_timeout_s)
        ports = self.ray.get([a.listen.remote() for a in actors], timeout=self.config.start_timeout_s)
        self.server_addresses = [f"{w['address']}:{p}" for w, p in zip(wheres, ports, strict=True)]
        starts = []
        for i, (actor, where) in enumerate(zip(actors, wheres, strict=True)):
            server = _Rank(f"server{i}", actor, where)
            argv = ["-u", "-m", "loom.ray.rank_main", "-m", "loom.ps.server", "--index", str(i),
                    "--num-servers", str(count), "--bind", self.server_addresses[i]]  # fmt: skip
            starts.append(self._start(server, argv, self._base_env(where), f"server{i}", None))
            self.servers.append(server)
        self._started(self.servers, starts)

    # -- one attempt ------------------------------------------------------------------------------------------
    def attempt(self, attempt: int) -> tuple[str | None, dict[int, bytes | None]]:
        """Run one attempt; returns its failure (None: it succeeded) and each rank's result."""
        self._wait_placed()
        ranks = self._place_workers()
        nodes = len({r.where["node_id"] for r in ranks})
        try:
            starts = [
                self._start(r, self.work.argv, self._rank_env(i, r, attempt, nodes),
                            f"attempt_{attempt}/rank{i}", self.work.payload)
                for i, r in enumerate(ranks)
            ]  # fmt: skip
            self._started(ranks, starts)
            failure = self._watch(ranks)
            return failure, {i: r.result for i, r in enumerate(ranks)}
        finally:
            self._stop(ranks)

    def _poll(self, procs: list[_Rank], stopping: bool = False) -> str | None:
        """One poll of every process not done yet; returns the failure to `blame`, if any. A lost parameter
        server ends the job (unless ``stopping``: then ends are expected)."""
        from ray.exceptions import GetTimeoutError, RayActorError

        live = [p for p in procs if not p.done]
        refs = [p.actor.poll.remote() for p in live]
        failures: list[tuple[int, float, str]] = []  # (kind, when, what): see `blame`
        for proc, ref in zip(live, refs, strict=True):
            try:
                report = self.ray.get(ref, timeout=self.config.start_timeout_s)
            except (RayActorError, GetTimeoutError) as error:
                proc.done = True
                what = "did not answer in time" if isinstance(error, GetTimeoutError) else "died"
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                text = f"{proc.title}: its Ray actor on {proc.where['host']} {what} ({reason})"
                failures.append((0, time.time(), text))
                continue
            prefix_print(proc.name, report["lines"], report["dropped"])
            for rel, offset, data in report["files"]:
                write_chunk(self.run_dir, proc.bases, rel, offset, data)
            if report["exit"] not in (None, 0):
                kind = 1 if report["exit"] < 0 else 2  # killed by a signal, else raised or exited non-zero
                text = exit_text(proc.title, report["exit"], report["error"])
                failures.append((kind, report["ended_at"] or time.time(), text))
            if report["done"]:
                proc.done, proc.result = True, report.get("result")
        servers = [f for f in failures if f[2].startswith("parameter server")]
        if servers and not stopping:
            raise RayJobFailed(f"{blame(servers)}; the model's shards it held are gone, so the job stops")
        return blame(failures) if failures else None

    def _watch(self, ranks: list[_Rank]) -> str | None:
        while not all(r.done for r in ranks):
            failure = self._poll(ranks + [s for s in self.servers if not s.done])
            if failure is not None:
                return failure
            time.sleep(self.config.poll_interval_s)
        return None

    def _stop(self, procs: list[_Rank]) -> None:
        """Stop the processes, copy their last output and files, and end their actors."""
        self._settle([p.actor.stop.remote(self.config.grace_s) for p in procs if not p.done])
        deadline = time.monotonic() + self.config.grace_s
        while any(not p.done for p in procs) and time.monotonic() < deadline:
            self._poll(procs, stopping=True)  # failures while stopping are the stop itself
        self._settle([p.actor.cleanup.remote() for p in procs])
        for p in procs:
            self.ray.kill(p.actor, no_restart=True)

    def _settle(self, refs: list[Any]) -> None:
        """Wait for calls made while stopping or cleaning up; a dead actor's error is expected (its process died
        with it)."""
        from ray.exceptions import RayError

        if not refs:
            return
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=self.config.grace_s + 10)
        for ref in ready:
            with contextlib.suppress(RayError):
                self.ray.get(ref)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            self._stop(self.servers)
        finally:
            remove_placement_group(self.group)
            self.store.close()
            self._remove_private_directories()
            if self.config.trace_steps:
                from loom.observe.trace import merge_traces_and_say

                merge_traces_and_say(self.run_dir, "loom")

    def _remove_private_directories(self) -> None:
        """A process's actor removes its private directory once copied; one whose actor died cannot, so a task
        on each node removes what is left there (a node that is gone took its directories with it)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from loom.ray.rank_host import remove_directories

        by_node: dict[str, list[str]] = {}
        for node, path in self.staged:
            by_node.setdefault(node, []).append(path)
        remove_directories(by_node.pop(self.node_id, []))
        task = self.ray.remote(num_cpus=0, max_retries=0)(remove_directories)
        refs = [
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(paths)
            for node, paths in by_node.items()
        ]
        self._settle(refs)


def run_job(config, work: WorkerSpec) -> dict[int, bytes | None]:
    """Run ``work`` on ``config.num_workers`` ranks until it succeeds or fails ``max_failures + 1`` times;
    returns each rank's pickled result (None for scripts). Raises `RayJobFailed` naming the failed rank."""
    from loom.ray.local import connect, disconnect

    try:
        import ray  # noqa: F401
    except ImportError:
        raise RayJobFailed("the Ray backend needs Ray. HINT: pip install 'loom-train[ray]'") from None
    started = time.monotonic()
    connection = connect(config.address, config.num_cpus)
    try:
        job = _Job(config, work)
        try:
            job.start_servers()
            attempt = 0
            while True:
                failure, results = job.attempt(attempt)
                if failure is None:
                    print(f"loom: finished on Ray in {time.monotonic() - started:.1f} s: {config.num_workers} "
                          f"worker(s), {attempt} restart(s); logs and metrics in {job.run_dir}", file=sys.stderr)  # fmt: skip
                    return results
                if attempt >= config.max_failures:
                    left = f"no restart left (max_failures={config.max_failures}). " if attempt else ""
                    raise RayJobFailed(f"{failure}; {left}Logs are in {job.run_dir / 'logs'}")
                attempt += 1
                print(f"loom: {failure}; replacing the worker group (restart {attempt} of "
                      f"{config.max_failures}), resuming from the latest checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            job.close()
    finally:
        disconnect(connection)
