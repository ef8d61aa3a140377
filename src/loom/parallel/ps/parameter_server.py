"""Data parallelism through sharded parameter servers: workers pull parameters and push gradients.

User guide, mode table and limits: docs/strategies/parameter-server.md. The parameters live on the servers in
size-balanced pieces (`loom.ps.plan`; placement: `loom.parallel.ps.parameter_server_pieces`) and the optimizer
given to `setup` runs *on the servers* (the worker's object only supplies its type and hyperparameters; every push
carries each param group's ``lr``, in ``sync`` the lowest rank's). Consistency is the server's (`loom.ps.clocks`).

Sparse tables (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): a forward pre-hook pulls just
the rows the batch touches and only those rows' gradients are pushed (the worker still allocates the table).
A restarted worker continues from its clock on the servers, so its pushes are not taken as resent; a restarted
server's lost updates are counted (`ParameterServerJob._note_restarts`). A step record's ``staleness``: updates
that reached the server between the pull and the application (largest over servers). Checkpoints:
`loom.parallel.ps.parameter_server_state`.

Limits: ``sync`` weights shares by ``batch.global_size`` (a plain tuple counts as one of ``world_size`` equal
shares); `eval_step` is collective.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.config_docs import document_options
from loom.devices import place_model
from loom.job import MetricFn
from loom.mesh import Mesh
from loom.parallel._setup import LossFn, Strategy, check_setup_arguments, step_metrics
from loom.parallel.ps.parameter_server_config import ParameterServerConfig, ParameterServerMetrics
from loom.parallel.ps.parameter_server_pieces import (
    json_hyperparameters,
    param_specs,
    piece_gradients,
    piece_view,
    set_pieces,
)
from loom.parallel.ps.parameter_server_state import load_worker_state, worker_state
from loom.ps.client import PSClient
from loom.ps.plan import Piece, check_frames, plan_shards
from loom.ps.shard import ShardSettings
from loom.ps.wire import MessageType, secret_from_hex
from loom.train.batch import batch_len
from loom.train.engine import Engine, StepState
from loom.train.options import NO_OBSERVER, refuse_options

__all__ = ["ParameterServer", "ParameterServerConfig", "ParameterServerJob", "ParameterServerMetrics"]


class ParameterServer(Strategy):
    """Strategy: parameters on sharded servers; ``ParameterServer(mode="ssp", staleness=2, ...)``."""

    config_type = ParameterServerConfig
    config: ParameterServerConfig

    def __init__(self, config: ParameterServerConfig | None = None, **options: Any) -> None:
        refuse_options(options, NO_OBSERVER, "ParameterServer")
        super().__init__(config, **options)

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn
    ) -> ParameterServerJob:
        """Plan the shards, connect, hand the initial parameters and the optimizer to the servers."""
        topo = self._topology()
        cfg = self.config
        check_setup_arguments(model, optimizer, loss_fn, strategy=f"ParameterServer(mode={cfg.mode!r})", conventions=True,
                              survives_lost_worker=cfg.mode != "sync", backend=topo.backend)  # sync waits for every worker's push  # fmt: skip
        place_model(model, topo.device, optimizer, topo.rank)  # the device rule; the wire carries CPU copies
        addresses = list(cfg.addresses or [a for a in os.environ.get("LOOM_PS_ADDRS", "").split(",") if a])
        secret_hex = cfg.secret or os.environ.get("LOOM_JOB_SECRET", "")
        if not addresses or not secret_hex:
            raise ValueError(
                "ParameterServer needs server addresses and the job secret (LOOM_PS_ADDRS, LOOM_JOB_SECRET). "
                "HINT: launch with `loom run -n N --servers K train.py`."
            )
        specs, sparse_modules = param_specs(model, optimizer)
        plan = plan_shards(specs, len(addresses))
        params = dict(model.named_parameters())
        check_frames(plan, params, len(addresses))
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
            groups=[json_hyperparameters(g) for g in optimizer.param_groups],
        )
        meta = {"ns": cfg.namespace, "worker": topo.rank, "settings": asdict(settings)}
        # Each server is told only its own pieces, so a server's --index need not match its place in the list.
        held = [[p for p in plan if p.server == s] for s in range(len(addresses))]
        metas = [{**meta, "pieces": [p.to_json() for p in pieces]} for pieces in held]
        values = [{f"p{p.id}": piece_view(params[p.name], p) for p in pieces} for pieces in held]
        replies = client.request(MessageType.INIT, metas, values, timeout_s=cfg.connect_timeout_s)
        metrics = step_metrics(topo, self.metrics_path, ParameterServerMetrics)
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


document_options(ParameterServer, ParameterServerConfig)


class ParameterServerJob(Engine):
    """A model trained through parameter servers (a `loom.job.Job`): `train_step`, `eval_step`, `state_dict`,
    plus `fetch_parameters`, `server_stats`, `close`.

    ``mesh`` is ``dp = world size`` over the workers. ``replicas_agree`` holds in ``sync`` without sparse tables:
    after a step every worker holds the parameters it pulled for that step, the same version everywhere (in
    ``async``/``ssp`` workers pull different versions, and sparse rows are pulled only where a batch touches
    them)."""

    replicated_state = False

    def __init__(self, module, optimizer, loss_fn, mesh: Mesh, config, client, plan, metrics) -> None:
        # `step` is this worker's clock: updates pushed so far. The guard's flags travel with the pushes
        # (`_synchronize`, `_flags`).
        super().__init__(module, optimizer, loss_fn, mesh, config, metrics)
        self.config: ParameterServerConfig = config
        self.client: PSClient = client
        self.plan: list[Piece] = plan
        self.metrics: ParameterServerMetrics = metrics
        self.replicas_agree = config.mode == "sync" and not any(p.sparse for p in plan)
        self.loss_scope = "global" if config.mode == "sync" else "replica"
        metrics.loss_scope = self.loss_scope
        self._params = dict(module.named_parameters())
        self._versions = [0] * len(client.links)
        self._held = [-1] * len(client.links)
        """The version of each server's values the module holds (-1: none known), so a pull skips the values
        it already has (`_pull_dense`)."""
        self._closed = False

    def _request(self, kind, meta, tensors=None, servers=None, timeout_s=None, per_server=None):
        servers = list(range(len(self.client.links))) if servers is None else servers
        base = {"ns": self.config.namespace, "worker": self.topology.rank, **meta}
        metas = [{**base, **(per_server[s] if per_server else {})} for s in servers]
        timeout = timeout_s if timeout_s is not None else self.config.worker_timeout_s + 30.0
        try:
            return self.client.request(kind, metas, tensors, servers=servers, timeout_s=timeout)
        finally:
            self._note_restarts()

    def _note_restarts(self) -> None:
        """Account for servers the client found restarted: one ``loom:`` line each, and an entry in
        ``metrics.server_restarts`` counting the updates this worker had seen applied there that the server lost
        (none in ``sync``, whose checkpoints are write-ahead; other workers may have seen a few more). A server
        restarted without the model (no checkpoint) raises, naming it."""
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
            self._held[server] = -1  # its values are to be pulled again, not assumed
            lost = max(0, seen - resumed)
            self.metrics.server_restarts.append({"server": server, "step": self.step, "time": event["time"],
                                                 "seen_version": seen, "resumed_version": resumed,
                                                 "lost_updates": lost})  # fmt: skip
            outcome = f"{lost} update(s) lost" if lost else "no update lost"
            print(f"{who} was restarted from its checkpoint at version {resumed} (this worker had seen version "
                  f"{seen}): {outcome}", flush=True)  # fmt: skip

    # -- pulling ----------------------------------------------------------------------------------------------
    def _pull_dense(self, peek: bool = False) -> None:
        have = [{"have": v} for v in self._held]  # a server replies without values this module holds already
        replies = self._request(MessageType.PULL, {"clock": self.step, "peek": peek}, per_server=have)
        if not peek:
            self.metrics.clocks.append((self.step, min(int(r.meta["slowest"]) for r in replies)))
        self._take_values(replies)

    def _take_values(self, replies: list[Any]) -> None:
        """Note each server's version, and write the values a reply carries into the module."""
        for server, reply in enumerate(replies):
            self._versions[server] = int(reply.meta["version"])
            if reply.tensors:
                set_pieces(self._params, self.plan, {int(k[1:]): v for k, v in reply.tensors.items()})
                self._held[server] = self._versions[server]

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
        for server, reply in zip(servers, replies, strict=True):  # writes through .data: autograd sees none
            for key, value in reply.tensors.items():
                piece = by_id[int(key[1:])]
                rows = requests[server][f"r{piece.id}"].to(weight.device) + piece.start
                weight.data[rows] = value.to(weight.device, weight.dtype)

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
        with self.collective("pull from the parameter servers"):
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
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]  # as a scheduler on the worker set them
        meta = {"clock": self.step, "loss_sum": state.loss_sum, "lrs": lrs, "pull": True}
        if state.flag:
            meta["nonfinite"] = state.flag
            grads: list[dict[str, torch.Tensor]] = [{} for _ in range(len(self.client.links))]
        else:
            grads = piece_gradients(self._params, self.plan, len(self.client.links))
        with self.collective("push to the parameter servers"):
            per_server = [{"version": v} for v in self._versions]
            replies = self._request(MessageType.PUSH, meta, grads, per_server=per_server)
        self._take_values(replies)  # the parameters after this step's update (unchanged if skipped)
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

    def _record(self, state: StepState, **fields: Any) -> None:
        super()._record(state, staleness=float(state.work["staleness"]), **fields)

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

    # -- state ------------------------------------------------------------------------------------------------
    def server_stats(self) -> list[dict[str, Any]]:
        """Each server's counters: dropped frames by reason, bytes, and per model version, staleness, clocks."""
        replies = self.client.request(MessageType.STATS, [{}] * len(self.client.links), timeout_s=30)
        return [f.meta for f in replies]

    def state_dict(self) -> dict[str, Any]:
        """This worker's part of a checkpoint (`loom.parallel.ps.parameter_server_state.worker_state`)."""
        return worker_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put this worker's part back; rank 0's also restores every server
        (`loom.parallel.ps.parameter_server_state.load_worker_state`). Collective with a process group."""
        load_worker_state(self, state)

    def close(self) -> None:
        """Tell the servers this worker is done (so ``ssp`` peers stop waiting for it) and disconnect."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(TimeoutError, RuntimeError):
            self._request(MessageType.BYE, {}, timeout_s=5.0)
        self.client.close()
