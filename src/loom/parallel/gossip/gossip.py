"""Decentralized, asynchronous data parallelism: each worker averages its parameters with one peer at a time.

User guide, example and limits: docs/strategies/gossip.md (randomized gossip, Boyd et al. 2006; SGP's exponential
graph, Assran et al. 2019; AD-PSGD's asynchronous pairs, Lian et al. 2018).

The exchange is symmetric: the worker sends its parameters ``a`` (`loom.comm.peer`), the peer answers with its
own ``b`` and takes ``m = (a + b) / 2``; on the answer the worker takes ``m + (x - a)``, ``x`` being what it holds
by then, so the share of peers answered meanwhile is kept and every exchange, interleaved or not, conserves the
sum of the replicas. A pair exchange rather than push-sum weights: replicas hold plain parameters at every step
(no de-biasing, no weight lost with a dead peer), and a pair's result is testable bit for bit (crossing and late
requests: `loom.comm.peer`). Non-finite values are never sent nor taken.

A service thread answers peers between steps, so ``job.module`` may change between two `train_step` calls;
`paused` holds it still. Set-up is the only collective part (addresses through the job's store; with
``same_start``, rank 0's parameters broadcast), besides `eval_step` and `loom.fit`'s checkpoints (docs page).
"""

from __future__ import annotations

import atexit
import contextlib
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.comm.counters import counters
from loom.comm.links import _job_secret
from loom.comm.peer import PeerNode
from loom.comm.peer_wire import COPY, EXCHANGE, PeerStats
from loom.config_docs import document_options
from loom.job import MetricFn
from loom.mesh import Mesh
from loom.observe.metrics import StepMetrics
from loom.parallel._setup import LossFn, Strategy, check_setup_arguments, step_metrics
from loom.parallel.gossip.gossip_config import GossipConfig
from loom.parallel.gossip.gossip_exchange import (
    IdleServer,
    ParameterLayout,
    PeerChoice,
    PeerDirectory,
    average_into,
)
from loom.train.batch import batch_len
from loom.train.engine import Engine, StepState
from loom.train.options import NO_OBSERVER, refuse_options

__all__ = ["Gossip", "GossipConfig", "GossipJob"]


class Gossip(Strategy):
    """Strategy: each worker trains its own replica and averages with one peer at a time, asynchronously.

    ``Gossip(peers="ring", every=1, deadline_s=10.0, ...)`` — see `GossipConfig` for the fields.
    """

    config_type = GossipConfig
    config: GossipConfig

    def __init__(self, config: GossipConfig | None = None, **options: Any) -> None:
        refuse_options(options, NO_OBSERVER, "Gossip")
        super().__init__(config, **options)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> GossipJob:
        """Listen, publish the address, meet the others in the store; a restarted worker copies a neighbour."""
        topo = self._topology()
        check_setup_arguments(
            model,
            optimizer,
            loss_fn,
            strategy="Gossip",
            survives_lost_worker=True,
            conventions=True,
            backend=topo.backend,
        )
        layout = ParameterLayout(model)
        devices = sorted({str(p.device) for p in layout.params})
        if layout.nbytes == 0 or devices != ["cpu"]:
            raise ValueError(
                f"Gossip exchanges floating-point parameters from host memory; this model has {layout.nbytes} "
                f"bytes of them, on {devices}. HINT: keep the model on the CPU, with floating-point parameters."
            )
        metrics = step_metrics(topo, self.metrics_path)
        mesh = Mesh(dp=topo.world_size, topology=topo)
        job = GossipJob(model, optimizer, loss_fn, mesh, self.config, layout, metrics)
        if topo.is_distributed:
            job._connect()
        atexit.register(job.close)
        return job


document_options(Gossip, GossipConfig)


class GossipJob(Engine):
    """A replica trained by gossip (a `loom.job.Job`): `train_step`, `eval_step`, `state_dict`, plus
    `comm_stats`, `paused` and `close`. ``replicas_agree`` and ``replicated_state`` are False."""

    replicas_agree = False
    replicated_state = False
    loss_scope = "replica"

    def __init__(self, module, optimizer, loss_fn, mesh: Mesh, config, layout, metrics) -> None:
        # the guard judges this replica's own flag; `step` counts the optimizer steps this replica took
        super().__init__(module, optimizer, loss_fn, mesh, config, metrics)
        self.config: GossipConfig = config
        self.layout: ParameterLayout = layout
        self.metrics: StepMetrics = metrics
        metrics.loss_scope = self.loss_scope
        self.choice = PeerChoice(config.peers, self.topology.rank, self.topology.world_size, config.seed)
        self.attempts = 0  # exchanges this worker was due to make
        self.joined_from: int | None = None  # the peer copied when this worker joined a running job
        self.distance: dict[int, float] = {}  # per peer: L2 distance at the last exchange with it
        self.node: PeerNode | None = None
        self.directory: PeerDirectory | None = None
        self._passed_over: dict[int, int] = {}
        self._server: IdleServer | None = None
        self._closed = self._joining = False
        self._recorded = (0, 0)

    def _connect(self) -> None:
        topo, cfg = self.topology, self.config
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"Gossip on rank {topo.rank} of {topo.world_size} needs the job's store to find its peers, and "
                "this process has not joined the job. HINT: call loom.init() first and start with `loom run`."
            )
        secret = _job_secret(topo.rank)
        if secret is None:
            raise ValueError(
                f"rank {topo.rank}: Gossip authenticates its peers with LOOM_JOB_SECRET, which is unset or "
                "shorter than 32 hex digits. HINT: start the job with `loom run` (it generates one), or set the "
                "same 64 hex digits (openssl rand -hex 32) on every node."
            )
        self.directory = PeerDirectory(dist.distributed_c10d._get_default_store(), cfg.namespace, topo)
        joins = self.directory.count_join()
        self.node = PeerNode(
            topo.rank, topo.world_size, secret, self.layout.nbytes, self.layout.fingerprint,
            self._serve, self.directory.address_of,
        )  # fmt: skip
        self.directory.publish(self.node.address)
        if joins == 1:
            self.directory.wait_for_all(cfg.setup_timeout_s)
            if cfg.same_start:
                for p in self.layout.params:
                    dist.broadcast(p.data, group=topo.group, group_src=0)
        else:
            self._joining = True
            try:
                self._join()
            finally:
                self._joining = False
        self._server = IdleServer(self.node, topo.rank)

    def _join(self) -> None:
        """Copy the parameters of the first live peer in this worker's order of asking (meanwhile, requests
        from peers are refused: this replica's values are stale or arbitrary until then)."""
        assert self.node is not None
        rank, world = self.topology.rank, self.topology.world_size
        nearest = [(rank + 1) % world, (rank - 1) % world, *((rank + d) % world for d in range(2, world))]
        for peer in dict.fromkeys(nearest):  # right neighbour, left, then the others (once each)
            got: list[torch.Tensor] = []
            if self.node.request(peer, COPY, None, self.config.deadline_s, got.append) == "done":
                with torch.no_grad():
                    for i, p in enumerate(self.layout.params):
                        p.copy_(self.layout.view(got[0], i))
                self.joined_from = peer
                return
        warnings.warn(
            f"rank {self.topology.rank}: joining a running gossip job, no peer answered a copy request "
            f"({self.node.errors}); this replica starts from its own parameters",
            stacklevel=4,
        )

    def _serve(self, kind: int, peer: int, theirs: torch.Tensor | None) -> torch.Tensor | None:
        """Answer a peer (in the thread that pumps): our values; for EXCHANGE also take the pair's mean."""
        if self._joining:
            return None  # its own values are not the job's yet: never spread them
        mine = self.layout.pack()
        if not self.layout.finite(mine) or (theirs is not None and not self.layout.finite(theirs)):
            return None
        if kind == EXCHANGE:
            assert theirs is not None
            self.distance[peer] = average_into(self.layout, theirs, mine, serving=True)
        return mine

    def _gossip(self) -> None:
        assert self.node is not None
        self.attempts += 1
        for _ in range(self.topology.world_size - 1):
            peer = self.choice.next()
            if self._passed_over.get(peer, 0) < self.attempts:
                break
        else:
            return  # every peer is passed over for now
        sent = self.layout.pack()
        if not self.layout.finite(sent):
            return  # a diverged replica keeps its values to itself

        def merge(theirs: torch.Tensor) -> None:  # now, or later if the answer is late
            self.distance[peer] = average_into(self.layout, theirs, sent, serving=False)

        outcome = self.node.request(peer, EXCHANGE, sent, self.config.deadline_s, merge)
        if outcome in ("late", "unreachable"):
            self._passed_over[peer] = self.attempts + self.config.retry_after
            if outcome == "unreachable":
                self.distance.pop(peer, None)  # a dead peer's last distance says nothing about the replicas

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """No peer changes the parameters inside this block (answers wait until it ends)."""
        return self._server.paused() if self._server is not None else contextlib.nullcontext()

    # -- the engine's hooks (`loom.train.engine`) ---------------------------------------------------------------
    def _check_can_train(self) -> None:
        if self._server is not None:
            self._server.check(self.topology.rank)

    def _step_context(self) -> contextlib.AbstractContextManager[None]:
        return self.paused()

    def _prepare(self, state: StepState) -> None:
        if self.node is not None:
            self.node.pump(0.0)
        state.local = batch_len(self.loss_call.inputs_of(state.batch))
        state.total = int(getattr(state.batch, "global_size", state.local * self.topology.world_size))

    def _forward_backward(self, state: StepState) -> None:
        """This replica's loss on its share; no backward once a loss is non-finite."""
        self._backward_share(state, self.config.accumulate, weight_of_total=False, stop_on_nonfinite=True)
        state.loss = state.work.get("share_mean", 0.0)

    def _synchronize(self, state: StepState) -> None:
        """Nothing to reduce: each replica judges its own flag (a non-finite replica's values are never sent).
        ``state.loss`` is this replica's mean loss on its share (``loss_scope="replica"``; 0.0 when empty)."""
        state.flags, state.ranks = [state.flag], [self.topology.rank]

    def _apply(self, state: StepState) -> None:
        if state.local:
            self.optimizer.step()

    def _after_step(self, state: StepState) -> None:
        """One exchange every ``every`` steps, timed for the step record."""
        exchanged = time.perf_counter()
        if self.node is not None and state.number % self.config.every == 0:
            self._gossip()
        state.work["comm_s"] = time.perf_counter() - exchanged
        state.work["traffic"] = self._record_traffic()

    def _record(self, state: StepState, **fields: Any) -> None:
        sent, received = state.work["traffic"]
        super()._record(
            state, comm_s=state.work["comm_s"], bytes_sent=sent, bytes_received=received,
            spread=max(self.distance.values(), default=0.0), **fields,
        )  # fmt: skip

    def _record_traffic(self) -> tuple[int, int]:
        """Bytes moved since the last call (service thread included), added to ``loom.comm.counters()``."""
        if self.node is None:
            return 0, 0
        now = (self.node.stats.bytes_sent, self.node.stats.bytes_received)
        sent, received = now[0] - self._recorded[0], now[1] - self._recorded[1]
        self._recorded = now
        if sent or received:
            counters().record("gossip", sent, received)
        return sent, received

    def _evaluate(self, batch: Any, metrics: dict[str, MetricFn] | None) -> tuple[list[str], torch.Tensor]:
        """Each replica's own parameters on its share (no peer changes them meanwhile); the engine sums the
        shares, so the result is the same on every rank."""
        with self.paused():
            return super()._evaluate(batch, metrics)

    def state_dict(self) -> dict[str, Any]:
        """This replica's model, optimizer, step and peer choice (tensors and numbers). The parameters are
        copied: a peer's exchange may change them in place as soon as this returns."""
        with self.paused():
            return {
                "model": {k: v.clone() for k, v in self.module.state_dict().items()},
                "optimizer": self.optimizer.state_dict(),
                "step": self.step,
                "gossip": {**self.choice.state_dict(), "attempts": self.attempts},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.paused():
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            self.choice.load_state_dict(state["gossip"])
            self.attempts = int(state["gossip"]["attempts"])

    def comm_stats(self) -> dict[str, float]:
        """This transport's bytes (also ``loom.comm.counters()["gossip"]``) and exchanges by outcome
        (`loom.comm.peer_wire.PeerStats`), ``spread`` (largest L2 distance to a peer at the last exchange with each
        reachable peer), ``joined_from`` (the peer copied on joining a running job, -1: none) and ``step``."""
        stats = (self.node.stats if self.node else PeerStats()).as_dict()
        spread, joined = max(self.distance.values(), default=0.0), self.joined_from
        return {**stats, "spread": spread, "joined_from": -1 if joined is None else joined, "step": self.step}

    def close(self) -> None:
        """Stop serving; wait (at most ``deadline_s``) for this worker's late answers; close the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None and self.node is not None:
            self._server.stop()
            self.node.close(drain_s=self.config.deadline_s)
            self._record_traffic()
        self.metrics.close()
