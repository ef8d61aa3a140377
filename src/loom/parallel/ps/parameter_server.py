"""Data parallelism through sharded parameter servers: workers pull parameters and push gradients.

``loom run -n 4 --servers 2 train.py`` with ``strategy = loom.ParameterServer(mode="ssp", staleness=2)``: the
parameters live on the servers, cut into size-balanced pieces (`loom.ps.plan`), and the optimizer given to
`setup` runs *on the servers* over those pieces (its state is sharded with them; the worker's optimizer object
only supplies its type and hyperparameters and is never stepped). Each step a worker pulls the parameters, computes
the gradient of its share of the global batch, and pushes it. The consistency model (`loom.ps.clocks`) is the
server's: ``sync`` equals one process on the whole global batch (gradients weighted ``n_r / N`` and summed), while
``async`` and ``ssp`` apply each worker's mean gradient as its own update (so one global batch makes W updates;
lower the learning rate accordingly, as with Downpour SGD).

Sparse tables: the rows of an ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` are not pulled
with the dense parameters; a forward pre-hook pulls just the rows the batch's indices touch, and only those rows'
gradients are pushed, so traffic grows with touched rows, not with the table (the worker still allocates the table).

Learning-rate schedules: every push carries the learning rate of each param group of the worker's optimizer, and
the server sets it before applying that push, so a ``torch.optim.lr_scheduler`` stepped on the worker's optimizer
after each `train_step` drives the servers' optimizer (in ``sync`` the lowest rank's rates are used for a step;
all ranks run the same schedule). Only ``lr`` travels: schedules of other hyperparameters (``OneCycleLR``'s
momentum cycling) do not reach the servers.

Each step's `StepRecord` carries its ``staleness``: how many updates reached the server between the pull the
gradient was computed on and its own application (the largest over servers); ``metrics.staleness`` is the same
as a histogram. A worker that joins a model the servers already hold (a restarted worker) continues from its
clock there, so its pushes are not mistaken for resent ones.

Checkpoints (`loom.fit`): the job is a `loom.job.Job` whose state is not replicated (each worker has its own
clock), so every worker's `state_dict` goes into its own file of the checkpoint. Rank 0's also holds every
server's whole model (parameters, optimizer state, version, every worker's clock), read with a STATE request
while all workers wait in the checkpoint; on resume rank 0 sends it back with RESTORE, which replaces whatever
the servers hold (fresh servers of a new job, or servers that went on past the checkpoint while the workers were
restarted), and the workers agree before anyone pulls. In ``sync``, 10 steps + resume + 10 steps equals 20
steps bitwise (tests/test_ps_fit.py). A resume needs the same number of workers and servers.

A server's death (`loom.ps.server`, `loom.launch.servers`): under ``loom run`` a server that dies is restarted on
its address from its checkpoint, and the workers' requests are resent once it answers. ``sync`` saves every step
before answering it, so the job ends where an uninterrupted one would (the step in flight is repeated);
``async``/``ssp`` lose the updates since the last save (``checkpoint_interval_s``), which each worker counts and
prints when it finds the server back at an older version (``metrics.server_restarts``). A request that times out
names the server, its address, the operation, this worker's rank and what the launcher knows of the server's death.

Limits: ``sync`` weights shares by ``batch.global_size`` (a `loom.data.loader` batch); a plain tuple is assumed
to be one of ``world_size`` equal shares. Only element-wise optimizers are accepted (see `loom.ps.shard`).
`eval_step` sums over the process group, so every worker must call it (``loom.init()`` joins the group).
Buffers (BatchNorm statistics) stay local to each worker.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.config_docs import document_options
from loom.job import MetricFn
from loom.mesh import Mesh
from loom.observe.metrics import StepMetrics
from loom.parallel._setup import check_setup_arguments
from loom.ps.client import PSClient
from loom.ps.plan import ParamSpec, Piece, plan_shards
from loom.ps.shard import ShardSettings
from loom.ps.wire import MessageType, secret_from_hex
from loom.topology import Topology, current
from loom.train.batch import LossCall, batch_len
from loom.train.engine import Engine, ShareOptions, StepState
from loom.train.guard import StepGuard
from loom.train.options import config_from

__all__ = ["ParameterServer", "ParameterServerConfig", "ParameterServerJob", "ParameterServerMetrics"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ParameterServerConfig(ShareOptions):
    """How workers and servers agree on the parameters (and the step guard's options, `loom.train.guard`: the
    hang watchdog counts each step's pull and push as collectives of the workers, and a non-finite loss or
    gradient is never pushed)."""

    mode: str = "sync"
    """``sync`` (equals one process), ``async`` (apply on arrival, never wait) or ``ssp`` (bounded staleness)."""
    staleness: int = 0
    """``ssp`` only: a worker may run at most this many clocks ahead of the slowest live worker."""
    worker_timeout_s: float = 60.0
    """A worker silent this long is lost: ``ssp`` stops waiting for it, ``sync`` fails the step naming it."""
    connect_timeout_s: float = 60.0
    """How long `setup` waits for the servers to answer."""
    checkpoint_every: int | None = None
    """Servers save their shards after this many updates. None (default): every step in ``sync``, saved before
    the step's replies go out, so a server restarted from it is never behind a worker and only the step in flight
    is repeated; by time (``checkpoint_interval_s``) in ``async``/``ssp``. 0: not by count."""
    checkpoint_interval_s: float = 1.0
    """Servers also save once the oldest unsaved update is this many seconds old (and at least 20 times as long
    as their last save took: at most ~5% of a server's time goes to saving a large model). In ``async``/``ssp``
    it bounds what a server's death loses to about this many seconds of updates; time, not a count of updates,
    because the cost and the loss then do not depend on how many workers push how fast. With
    ``checkpoint_every=0`` and ``0`` here, servers save only on request and at shutdown (a restarted server then
    goes back to the start or the last save)."""
    namespace: str = "default"
    """Name of the model on the servers (several models can share servers)."""
    addresses: tuple[str, ...] | None = None
    """Server ``HOST:PORT`` list; default ``LOOM_PS_ADDRS`` (set by ``loom run --servers K``)."""
    secret: str | None = field(default=None, repr=False)
    """Job secret (hex); default ``LOOM_JOB_SECRET``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode not in ("sync", "async", "ssp"):
            raise ValueError(f"mode={self.mode!r}; use 'sync', 'async' or 'ssp'")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {self.staleness!r}")
        if self.staleness and self.mode != "ssp":
            raise ValueError(f"staleness={self.staleness} applies to mode='ssp' only, not {self.mode!r}")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s!r}")
        every = self.checkpoint_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
            raise ValueError(f"checkpoint_every must be None or an int >= 0, got {every!r}")
        if not 0 <= self.checkpoint_interval_s < float("inf"):
            raise ValueError(
                f"checkpoint_interval_s must be a number of seconds >= 0 (0: off), got {self.checkpoint_interval_s!r}"
            )

    def server_checkpoint_every(self) -> int:
        """``checkpoint_every`` resolved for this mode: 1 in ``sync`` by default, else 0 (by time only)."""
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return 1 if self.mode == "sync" else 0


class ParameterServerMetrics(StepMetrics):
    """Step records, plus the staleness of this worker's updates and the clocks its pulls were granted at."""

    def __init__(self, rank: int, path: str | None = None) -> None:
        super().__init__(rank, path)
        self.staleness: dict[int, int] = {}
        """Histogram: server version at apply minus the version the gradient was computed on -> updates."""
        self.clocks: list[tuple[int, int]] = []
        """Per pull: (this worker's clock, the slowest live worker's clock) when the pull was granted."""
        self.server_restarts: list[dict[str, Any]] = []
        """Per server restart this worker found: ``{"server", "step", "time" (Unix seconds of the restarted
        server's first answer), "seen_version", "resumed_version", "lost_updates"}`` (``lost_updates``: updates
        this worker saw applied that the restarted server no longer has)."""

    def summary(self, skip_first: int = 1) -> dict[str, Any]:
        lost = sum(r["lost_updates"] for r in self.server_restarts)
        return {**super().summary(skip_first), "staleness": dict(sorted(self.staleness.items())),
                "server_restarts": len(self.server_restarts), "lost_updates": lost}  # fmt: skip


class ParameterServer:
    """Strategy: parameters on sharded servers; ``ParameterServer(mode="ssp", staleness=2, ...)``."""

    def __init__(
        self,
        config: ParameterServerConfig | None = None,
        *,
        topology: Topology | None = None,
        metrics_path: str | None = None,
        **options: Any,
    ):
        self.config = config_from(ParameterServerConfig, config, options, "ParameterServer")
        self.topology = topology
        self.metrics_path = metrics_path

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn
    ) -> ParameterServerJob:
        """Plan the shards, connect, hand the initial parameters and the optimizer to the servers."""
        topo = self.topology if self.topology is not None else current()
        cfg = self.config
        check_setup_arguments(model, optimizer, loss_fn, strategy=f"ParameterServer(mode={cfg.mode!r})", conventions=True,
                              survives_lost_worker=cfg.mode != "sync")  # sync waits for every worker's push  # fmt: skip
        addresses = list(cfg.addresses or [a for a in os.environ.get("LOOM_PS_ADDRS", "").split(",") if a])
        secret_hex = cfg.secret or os.environ.get("LOOM_JOB_SECRET", "")
        if not addresses or not secret_hex:
            raise ValueError(
                "ParameterServer needs server addresses and the job secret (LOOM_PS_ADDRS, LOOM_JOB_SECRET). "
                "HINT: launch with `loom run -n N --servers K train.py`."
            )
        specs, sparse_modules = _param_specs(model, optimizer)
        plan = plan_shards(specs, len(addresses))
        client = PSClient(addresses, secret_from_hex(secret_hex))
        client.hello(cfg.connect_timeout_s)
        settings = ShardSettings(
            mode=cfg.mode,
            staleness=cfg.staleness,
            num_workers=topo.world_size,
            timeout_s=cfg.worker_timeout_s,
            checkpoint_every=cfg.server_checkpoint_every(),
            checkpoint_interval_s=float(cfg.checkpoint_interval_s),
            optimizer=type(optimizer).__name__,
            groups=[_json_hyperparameters(g) for g in optimizer.param_groups],
        )
        params = dict(model.named_parameters())
        meta = {"ns": cfg.namespace, "worker": topo.rank, "settings": asdict(settings)}
        # Each server is told only its own pieces, so a server's --index need not match its place in the list.
        metas = [
            {**meta, "pieces": [p.to_json() for p in plan if p.server == s]} for s in range(len(addresses))
        ]
        values: list[dict[str, torch.Tensor] | None] = [{f"p{p.id}": _piece_view(params[p.name], p) for p in plan if p.server == s}
                  for s in range(len(addresses))]  # fmt: skip
        replies = client.request(MessageType.INIT, metas, values, timeout_s=cfg.connect_timeout_s)
        metrics = ParameterServerMetrics(topo.rank, self.metrics_path)
        # The workers' mesh: the servers are not in the torch process group.
        mesh = Mesh(dp=topo.world_size, topology=topo)
        job = ParameterServerJob(model, optimizer, loss_fn, mesh, cfg, client, plan, metrics)
        # A restarted worker rejoins at its clock on the servers (a lagging restored server catches up).
        job.step = max(int(r.meta.get("clock", 0)) for r in replies)
        for name, module in sparse_modules.items():
            module.register_forward_pre_hook(job._row_hook(name))
        job._pull_dense(peek=True)  # start from the servers' values (another worker's INIT may have won)
        atexit.register(job.close)
        return job


document_options(ParameterServerConfig, ParameterServerConfig)
document_options(ParameterServer, ParameterServerConfig)


def _param_specs(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[ParamSpec], dict]:
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    sparse_modules = {
        f"{prefix}.weight" if prefix else "weight": m
        for prefix, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }
    specs = []
    for name, p in model.named_parameters():
        if id(p) not in group_of or not p.requires_grad:
            continue  # frozen: stays on the worker
        if name in sparse_modules:
            specs.append(ParamSpec(name, p.shape[0], p.shape[1], True, group_of[id(p)]))
        else:
            specs.append(ParamSpec(name, p.numel(), 1, False, group_of[id(p)]))
    return specs, {n: m for n, m in sparse_modules.items() if any(s.name == n for s in specs)}


def _json_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    def convert(key: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        if isinstance(value, (list, tuple)):
            return [convert(key, v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"optimizer hyperparameter {key}={value!r} cannot be sent to the parameter servers")

    return {k: convert(k, v) for k, v in group.items() if k != "params"}


def _piece_view(param: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The values of ``piece`` inside ``param`` (a view, writable)."""
    if piece.sparse:
        return param.data[piece.start : piece.stop]
    return param.data.view(-1)[piece.start : piece.stop]


class ParameterServerJob(Engine):
    """A model trained through parameter servers (a `loom.job.Job`): `train_step`, `eval_step`, `state_dict`,
    plus `fetch_parameters`, `server_stats`, `close`.

    ``mesh`` is ``dp = world size`` over the workers. Each worker has its own clock, so the state is not
    replicated (`loom.fit` writes every worker's part). ``replicas_agree`` holds in ``sync`` without sparse
    tables: after a step every worker holds the parameters it pulled for that step, the same version everywhere
    (in ``async``/``ssp`` workers pull different versions, and sparse rows are pulled only where a batch
    touches them)."""

    replicated_state = False

    def __init__(self, module, optimizer, loss_fn, mesh: Mesh, config, client, plan, metrics) -> None:
        self.module: nn.Module = module
        self.optimizer = optimizer
        self.loss_call = loss_fn if isinstance(loss_fn, LossCall) else LossCall(loss_fn)
        self.loss_fn = self.loss_call.fn
        self.mesh = mesh
        self.topology: Topology = mesh.topology
        self.config: ParameterServerConfig = config
        self.client: PSClient = client
        self.plan: list[Piece] = plan
        self.metrics: ParameterServerMetrics = metrics
        self.replicas_agree = config.mode == "sync" and not any(p.sparse for p in plan)
        self.loss_scope = "global" if config.mode == "sync" else "replica"
        metrics.loss_scope = self.loss_scope
        self.step = 0
        """This worker's clock: updates pushed so far."""
        self._params = dict(module.named_parameters())
        self._versions = [0] * len(client.links)
        self._closed = False
        self.guard = StepGuard.start(self.topology, config)
        """The hang watchdog over this worker's pulls and pushes and the non-finite verdict (`loom.train.guard`):
        a worker whose loss or gradient is non-finite pushes only its flag; in ``sync`` the server then applies
        nothing for the step and tells every worker whose flag it was (the same verdict everywhere), in
        ``async``/``ssp`` that worker's update alone is dropped."""
        self.nonfinite = self.guard.nonfinite
        self.last_step_skipped = False

    @property
    def _num_servers(self) -> int:
        return len(self.client.links)

    def _request(self, kind, meta, tensors=None, servers=None, timeout_s=None, per_server=None):
        servers = list(range(self._num_servers)) if servers is None else servers
        base = {"ns": self.config.namespace, "worker": self.topology.rank, **meta}
        metas = [{**base, **(per_server[s] if per_server else {})} for s in servers]
        timeout = timeout_s if timeout_s is not None else self.config.worker_timeout_s + 30.0
        try:
            return self.client.request(kind, metas, tensors, servers=servers, timeout_s=timeout)
        finally:
            self._note_restarts()

    def _note_restarts(self) -> None:
        """Account for servers the client found restarted: compare the version each resumed at with the last
        version this worker saw there; print one ``loom:`` line per restart and record it in
        ``metrics.server_restarts``. In ``sync`` (write-ahead checkpoints) nothing is lost; in ``async``/``ssp``
        the updates since the server's last checkpoint are, and this worker counts those it had seen applied
        (other workers may have seen a few more). A server restarted without the model (no checkpoint) cannot
        go on: that raises, naming the server."""
        for event in self.client.take_restarts():
            server, name = event["server"], self.config.namespace
            who = f"loom: worker rank {self.topology.rank}: parameter server {server} at {event['address']}"
            resumed = event["resumed"].get(name)
            if not isinstance(resumed, int) or isinstance(resumed, bool):
                raise RuntimeError(
                    f"{who} was restarted without model {name!r}: it had no checkpoint of it, so its parameters "
                    "are lost. HINT: keep server checkpoints on (ParameterServer(checkpoint_every=None, "
                    "checkpoint_interval_s > 0), the defaults) and the checkpoint folder ($LOOM_RUN_DIR/ps)"
                )
            seen = self._versions[server]
            lost = max(0, seen - resumed)
            self.metrics.server_restarts.append({"server": server, "step": self.step, "time": event["time"],
                                                 "seen_version": seen, "resumed_version": resumed,
                                                 "lost_updates": lost})  # fmt: skip
            outcome = f"{lost} update(s) lost" if lost else "no update lost"
            print(f"{who} was restarted from its checkpoint at version {resumed} (this worker had seen version "
                  f"{seen}): {outcome}", flush=True)  # fmt: skip

    # -- pulling ----------------------------------------------------------------------------------------------
    def _pull_dense(self, peek: bool = False) -> None:
        replies = self._request(MessageType.PULL, {"clock": self.step, "peek": peek})
        for server, reply in enumerate(replies):
            self._versions[server] = int(reply.meta["version"])
        if not peek:
            self.metrics.clocks.append((self.step, min(int(r.meta["slowest"]) for r in replies)))
        for reply in replies:
            self._set_pieces({int(key[1:]): value for key, value in reply.tensors.items()})

    def _set_pieces(self, values: dict[int, torch.Tensor]) -> None:
        """Write piece values (by piece id, as the servers hold them) into `module`."""
        by_id = {p.id: p for p in self.plan}
        with torch.no_grad():
            for pid, value in values.items():
                piece = by_id[pid]
                view = _piece_view(self._params[piece.name], piece)
                view.copy_(value.view_as(view))

    def _pull_rows(self, name: str, rows: torch.Tensor) -> None:
        """Pull the given rows of sparse table ``name`` from the servers holding them."""
        requests: dict[int, dict[str, torch.Tensor]] = {}
        for piece in (p for p in self.plan if p.name == name):
            local = rows[(rows >= piece.start) & (rows < piece.stop)] - piece.start
            if local.numel():
                requests.setdefault(piece.server, {})[f"r{piece.id}"] = local
        if not requests:
            return
        servers = sorted(requests)
        replies = self._request(MessageType.PULL_ROWS, {}, [requests[s] for s in servers], servers)
        by_id = {p.id: p for p in self.plan}
        weight = self._params[name]
        with torch.no_grad():
            for server, reply in zip(servers, replies, strict=True):
                for key, value in reply.tensors.items():
                    piece = by_id[int(key[1:])]
                    weight.data[requests[server][f"r{piece.id}"] + piece.start] = value.to(weight.dtype)

    def _row_hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self._pull_rows(name, args[0].reshape(-1).unique())

        return hook

    def fetch_parameters(self) -> nn.Module:
        """Copy the servers' current parameters (sparse tables whole) into `module`, without waiting on clocks."""
        self._pull_dense(peek=True)
        for name in {p.name for p in self.plan if p.sparse}:
            self._pull_rows(name, torch.arange(self._params[name].shape[0]))
        return self.module

    # -- training: the engine's hooks (`loom.train.engine`) -----------------------------------------------------
    def _prepare(self, state: StepState) -> None:
        """Pull the parameters for this step (in ``ssp``, waiting for the slowest clock within the bound)."""
        state.local = batch_len(self.loss_call.inputs_of(state.batch))
        state.total = int(getattr(state.batch, "global_size", state.local * self.topology.world_size))
        with self.guard.collective("pull from the parameter servers"):
            self._pull_dense()

    def _forward_backward(self, state: StepState) -> None:
        """This share's gradient, weighted by its share of the global batch in ``sync`` (the servers sum)."""
        for p in self._params.values():
            p.grad = None
        self._backward_share(state, self.config.accumulate, weight_of_total=self.config.mode == "sync")

    def _synchronize(self, state: StepState) -> None:
        """Push the gradient (or, when it is non-finite, only the flag: the gradient never travels). The
        servers apply it (in ``sync``, once every worker pushed, unless some worker's flag is set) and reply
        with the versions, the staleness and, in ``sync``, every worker's flag and the step's loss sum."""
        sync = self.config.mode == "sync"
        meta = {"clock": self.step, "loss_sum": state.loss_sum, "lrs": self._learning_rates()}
        if state.flag:
            meta["nonfinite"] = state.flag
        with self.guard.collective("push to the parameter servers"):
            replies = self._request(
                MessageType.PUSH,
                meta,
                self._gradients() if not state.flag else [{} for _ in range(self._num_servers)],
                per_server=[{"version": v} for v in self._versions],
            )
        for server, reply in enumerate(replies):
            self._versions[server] = int(reply.meta["version"])
        stale = max(int(r.meta.get("staleness", 0)) for r in replies)
        self.metrics.staleness[stale] = self.metrics.staleness.get(stale, 0) + 1
        state.work["staleness"] = stale
        # The optimizer step ran on the servers; a scheduler on the local optimizer checks this flag (which the
        # local step would have set) and would otherwise warn that it is stepped before the optimizer.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        state.flags, state.ranks = self._flags(replies, state.flag)
        assert state.total is not None
        # A push the servers had applied already (resent after a restart) comes back without the step's loss.
        if sync and "loss_sum" in replies[0].meta:
            state.loss = float(replies[0].meta["loss_sum"]) / state.total
        else:
            state.loss = state.loss_sum / max(state.local, 1)

    def _apply(self, state: StepState) -> None:
        """Nothing here: the servers applied the update (or, for a flagged step, did not)."""

    def _record(self, state: StepState) -> None:
        extra = {"skipped": True} if state.skipped else {}
        self.metrics.record(
            state.number, time.perf_counter() - state.started, state.local, state.total or 0, state.loss,
            staleness=float(state.work["staleness"]), **extra,
        )  # fmt: skip

    def _flags(self, replies: list[Any], flag: float) -> tuple[list[float], Sequence[int]]:
        """The flags the guard judges: in ``sync`` every worker's as the servers collected them
        (``[[worker, flag], ...]`` in each reply, the same for every worker), else this worker's own."""
        world = self.topology.world_size
        if self.config.mode != "sync":
            return [flag], [self.topology.rank]
        flags = [0.0] * world
        for reply in replies:
            for worker, value in reply.meta.get("flags", []):
                if 0 <= int(worker) < world:
                    flags[int(worker)] = max(flags[int(worker)], float(value))
        return flags, range(world)

    def _learning_rates(self) -> list[float]:
        """The current ``lr`` of each param group of the local optimizer (where a scheduler changes it)."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def _evaluate(self, batch: Any, metrics: dict[str, MetricFn] | None) -> tuple[list[str], torch.Tensor]:
        """On the servers' current parameters (pulled first, outside the consistency model); the engine adds up
        the workers' shares over the process group, so every worker calls it."""
        if self.topology.is_distributed and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"eval_step on rank {self.topology.rank} of {self.topology.world_size} needs the process group "
                "to add up the workers' shares, and this process has not joined it. HINT: call loom.init() at "
                "the start of the script (or evaluate locally: fetch_parameters() and run module)."
            )
        self._pull_dense(peek=True)
        return super()._evaluate(batch, metrics)

    def _gradients(self) -> list[dict[str, torch.Tensor]]:
        """Per server: ``g<id>`` dense gradient slices; for sparse pieces ``r<id>`` rows and ``g<id>`` values."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(self._num_servers)]
        sparse_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for piece in self.plan:
            grad = self._params[piece.name].grad
            if grad is None:
                continue
            target = out[piece.server]
            if not piece.sparse:
                target[f"g{piece.id}"] = grad.reshape(-1)[piece.start : piece.stop]
                continue
            if piece.name not in sparse_cache:
                g = (grad if grad.is_sparse else grad.to_sparse(1)).coalesce()
                sparse_cache[piece.name] = (g.indices()[0], g.values())
            rows, values = sparse_cache[piece.name]
            mask = (rows >= piece.start) & (rows < piece.stop)
            target[f"r{piece.id}"] = rows[mask] - piece.start
            target[f"g{piece.id}"] = values[mask]
        return out

    # -- state ------------------------------------------------------------------------------------------------
    def server_stats(self) -> list[dict[str, Any]]:
        """Each server's counters: dropped frames by reason, bytes, and per model version, staleness, clocks."""
        return [
            f.meta for f in self.client.request(MessageType.STATS, [{}] * self._num_servers, timeout_s=30)
        ]

    def save_servers(self) -> list[str]:
        """Ask every server to checkpoint its shards now; returns the files written."""
        replies = self.client.request(MessageType.SAVE, [{}] * self._num_servers, timeout_s=60)
        return [path for r in replies for path in r.meta["saved"]]

    def state_dict(self) -> dict[str, Any]:
        """This worker's part of a checkpoint: its clock (``step``), the server versions it last saw, its
        module (the servers' current parameters, its own buffers) and its optimizer's param groups (the learning
        rates its pushes carry); on rank 0 also ``servers``, every server's whole state
        (`loom.ps.shard.ModelShard.state`: parameters, optimizer state, version, every worker's clock), read
        with STATE. Tensors and JSON only.

        The servers' state is a consistent snapshot when no worker is inside a step, as at `loom.fit`'s
        checkpoints (every worker enters them after its step and leaves after the write). Each server's state
        travels in one frame, so it must fit the wire's payload limit (256 MiB by default: about 21 million
        float32 parameters per server with Adam's two moments)."""
        servers = None
        if self.topology.rank == 0:
            replies = self._request(MessageType.STATE, {})
            servers = [{"meta": r.meta["state"], "tensors": dict(r.tensors)} for r in replies]
            for index, server in enumerate(servers):
                self._versions[index] = int(server["meta"]["version"])
                pieces = {k: v for k, v in server["tensors"].items() if k.startswith("piece.")}
                self._set_pieces({int(k.split(".")[1]): v for k, v in pieces.items()})
        else:
            self.fetch_parameters()
        return {
            "model": self.module.state_dict(),
            # Never stepped, but its param groups hold the learning rates a scheduler set, which every push sends.
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "server_versions": list(self._versions),
            "servers": servers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this worker's part of a checkpoint; the part holding ``servers`` (rank 0's) also puts every
        server back to its saved state (RESTORE). The checkpoint wins over what the servers hold: fresh servers
        (a new job) or servers that went on past it (workers restarted under ``loom run --max-restarts``) end up
        at the saved parameters, optimizer state, version and every worker's clock. Each worker sets its own
        clock; then the workers agree that the restore succeeded (which is also a barrier, so none pulls before
        it) and pull the restored parameters.

        Collective when there is a process group: every worker calls it, as `loom.fit`'s resume does. Without
        one, no worker may train before every worker's call has returned."""
        failure: Exception | None = None
        try:
            if state.get("servers") is not None:
                self._restore_servers(state["servers"])
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
        except Exception as error:  # reported on every worker below, so none is left waiting
            failure = error
        if self.topology.is_distributed and dist.is_available() and dist.is_initialized():
            failed = torch.tensor(
                [0 if failure is None else self.topology.rank + 1], device=self.topology.device
            )
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.mesh.group("dp"))
            if failure is None and int(failed.item()):
                raise RuntimeError(
                    f"rank {self.topology.rank}: worker rank {int(failed.item()) - 1} could not restore its part "
                    "of the parameter-server checkpoint (its error says why)"
                )
        if failure is not None:
            raise failure
        self._versions = [0] * self._num_servers  # the restore set the versions back on purpose: nothing lost
        self._pull_dense(peek=True)

    def _restore_servers(self, servers: list[dict[str, Any]]) -> None:
        if len(servers) != self._num_servers:
            raise ValueError(
                f"the checkpoint holds the state of {len(servers)} parameter server(s), this job has "
                f"{self._num_servers}. HINT: resume with the same number of servers (loom run --servers)."
            )
        # One token for every send of this restore: a resent copy arriving late is not applied again.
        self._request(
            MessageType.RESTORE,
            {"token": os.urandom(16).hex()},
            [dict(s["tensors"]) for s in servers],
            per_server=[{"state": s["meta"]} for s in servers],
        )

    def close(self) -> None:
        """Tell the servers this worker is done (so ``ssp`` peers stop waiting for it) and disconnect."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(TimeoutError, RuntimeError):
            self._request(MessageType.BYE, {}, timeout_s=5.0)
        self.client.close()
