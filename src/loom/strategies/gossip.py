"""Decentralized, asynchronous data parallelism: each worker averages its parameters with one peer at a time.

``Gossip(peers="ring", every=1, deadline_s=10.0)``: every worker trains its own replica on its share of each
global batch (``job.loader``, sharded over the data axis like every strategy) with its own optimizer, and every
``every`` steps averages its parameters with ONE peer, at its own pace: no all-reduce, no barrier, no collective
over the group anywhere in the training loop, and no node everyone waits for (gossip SGD; the pairwise averaging
of Boyd et al., "Randomized gossip algorithms", 2006; the exponential graph of Assran et al., "Stochastic Gradient
Push", 2019, and AD-PSGD, Lian et al. 2018, for the asynchronous pairing).

The exchange is symmetric and exact: the worker sends its parameters ``a`` to the peer (`loom.comm.peer`), the peer
answers with its own ``b`` and sets its parameters to ``m = (a + b) / 2``; on the answer the worker sets its own to
``m + (x - a)``, where ``x`` is what it holds by then. When nothing else touched ``x`` (``x == a``) both sides end
with the same bits (``a + b`` is commutative in floating point and the halving is exact); when the worker answered
other peers while it waited, ``x - a`` keeps their share, so the sum of the replicas' parameters is conserved by
every exchange, interleaved or not, and with learning stopped (lr 0) the replicas converge to the mean of their
initial parameters. Why a pair exchange rather than push-sum weights: the replicas hold plain parameters at every
step (no de-biasing by a weight before a forward, nothing that drifts when a peer dies with its weight), and a
pair's result is testable bit for bit. Two workers asking each other at once: the lower rank answers BUSY, so
exactly one of the two exchanges happens. Non-finite parameters are never sent nor accepted (BUSY).

Peers: ``ring`` alternates the right and left neighbours (rank ± 1), ``exponential`` cycles through rank + 2^k for
k = 0 .. ⌊log2(W-1)⌋, ``random`` draws uniformly among the others (seeded by ``seed`` and the rank). A peer that is
dead (its connection closes or refuses) is skipped at once, a slow one after ``deadline_s``; either is passed over
for the next ``retry_after`` exchanges, and training goes on. A late answer is still applied when it comes (both
ends of an exchange apply it, or neither). A peer that joins a running job (the same rank set up again under the
same store: a restarted worker) copies a live neighbour's parameters before its first step.

Between steps a worker answers its peers from a service thread, so ``job.module``'s parameters may change between
two `train_step` calls; `paused` holds them still (`state_dict`, `eval_step` and `train_step` do). `comm_stats`
gives the bytes (only this transport's point-to-point traffic; also added to ``loom.comm.counters()`` under
``gossip``), the exchanges by outcome, and the spread: the largest parameter distance ``|a - b|`` (L2, over all
averaged parameters) to each peer at this worker's last exchange with it, measured on the values exchanged, at
no extra cost.

Set-up is the only collective part: each worker publishes its listener's address in the job's store and waits for
the others'; with ``same_start`` rank 0's parameters are broadcast. `train_step` returns THIS replica's mean loss on
its share (there is no global loss without a collective); `eval_step` is collective, each replica evaluating its
share with its own parameters. Checkpoints (`loom.fit`): the state is per rank (model, optimizer, step, peer
choice); a checkpoint is each replica at its own moment (an exchange may straddle it), and `loom.fit`'s saving
is collective, so it needs every worker alive. Limits: parameters are averaged, buffers (BatchNorm statistics)
and optimizer state stay local; floating-point parameters only; CPU tensors (the transport sends host memory).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.comm.counters import counters
from loom.comm.links import _job_secret
from loom.comm.peer import COPY, EXCHANGE, PeerNode
from loom.config_docs import document_options
from loom.fault.desync import gradients_finite
from loom.job import Job, MetricFn, check_batch_layout
from loom.mesh import Mesh
from loom.observe.metrics import StepMetrics
from loom.strategies._batch import batch_len, split_batch
from loom.strategies._setup import check_setup_arguments
from loom.strategies.data_parallel import default_metrics_path
from loom.topology import Topology, current

__all__ = ["Gossip", "GossipConfig", "GossipJob", "PeerChoice", "ParameterLayout"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
PEERS = ("ring", "exponential", "random")


@dataclass(frozen=True)
class GossipConfig:
    """How each worker picks its peers and how long it waits for them."""

    peers: str = "ring"
    """Peer of each exchange: ``ring`` (right and left neighbours in turn), ``exponential`` (rank + 2^k, k
    cycling) or ``random`` (uniform among the others)."""
    every: int = 1
    """Steps between two exchanges of this worker (each with one peer)."""
    deadline_s: float = 10.0
    """Longest one exchange may hold a worker (connecting and the peer's answer, which comes at the peer's next
    step boundary); past it the exchange is skipped and training goes on. Set it above the slowest step time."""
    retry_after: int = 8
    """Exchanges for which a peer that was unreachable or late is passed over before it is tried again."""
    same_start: bool = True
    """Start every replica from rank 0's parameters (one broadcast at set-up); False keeps each one's own."""
    seed: int = 0
    """Seeds the ``random`` peer choice (with the rank)."""
    namespace: str = "default"
    """Name of this gossip group in the job's store (two groups in one job need two names)."""
    setup_timeout_s: float = 300.0
    """How long set-up waits for every worker to publish its address."""

    def __post_init__(self) -> None:
        if self.peers not in PEERS:
            raise ValueError(f"peers={self.peers!r} is not one of {list(PEERS)}")
        for name in ("every", "retry_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("deadline_s", "setup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not self.namespace or "/" in self.namespace:
            raise ValueError(f"namespace must be a non-empty name without '/', got {self.namespace!r}")


class PeerChoice:
    """The sequence of peers one worker asks (see `GossipConfig.peers`); its position is checkpointed."""

    def __init__(self, kind: str, rank: int, world_size: int, seed: int = 0) -> None:
        self.kind, self.rank, self.world_size = kind, rank, world_size
        self.count = 0
        """Peers chosen so far."""
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def next(self) -> int:
        k, world = self.count, self.world_size
        self.count += 1
        if self.kind == "ring":
            return (self.rank + (1 if k % 2 == 0 else -1)) % world
        if self.kind == "exponential":
            return (self.rank + 2 ** (k % (world - 1).bit_length())) % world
        other = int(torch.randint(world - 1, (1,), generator=self.generator))
        return other if other < self.rank else other + 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.generator.set_state(state["generator"])


class ParameterLayout:
    """The floating-point parameters of a model packed back to back (each at a multiple of 8 bytes) in one
    uint8 tensor: what an exchange sends. ``fingerprint`` hashes names, dtypes and shapes (peers must match)."""

    def __init__(self, model: nn.Module) -> None:
        self.params: list[torch.Tensor] = []
        self.slots: list[tuple[int, int]] = []
        described, offset = [], 0
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            size = p.numel() * p.element_size()
            self.params.append(p)
            self.slots.append((offset, size))
            described.append(f"{name}|{p.dtype}|{tuple(p.shape)}")
            offset += -(-size // 8) * 8
        self.nbytes = offset
        digest = hashlib.sha256(";".join(described).encode()).digest()
        self.fingerprint = int.from_bytes(digest[:8], "big")

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        offset, size = self.slots[i]
        p = self.params[i]
        return flat[offset : offset + size].view(p.dtype).view(p.shape)

    def pack(self) -> torch.Tensor:
        flat = torch.zeros(self.nbytes, dtype=torch.uint8)  # zeros: padding must not carry stale memory
        for i, p in enumerate(self.params):
            self.view(flat, i).copy_(p.detach())
        return flat

    def finite(self, flat: torch.Tensor) -> bool:
        return gradients_finite([self.view(flat, i) for i in range(len(self.params))])


class Gossip:
    """Strategy: each worker trains its own replica and averages with one peer at a time, asynchronously.

    ``Gossip(peers="ring", every=1, deadline_s=10.0, ...)`` — see `GossipConfig` for the fields.
    """

    def __init__(self, *, topology: Topology | None = None, metrics_path: str | None = None, **config: Any):
        self.config = GossipConfig(**config)
        self.topology = topology
        self.metrics_path = metrics_path

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> GossipJob:
        """Listen, publish the address, meet the others in the store; a restarted worker copies a neighbour."""
        topo = self.topology if self.topology is not None else current()
        check_setup_arguments(model, optimizer, loss_fn)
        layout = ParameterLayout(model)
        if layout.nbytes == 0:
            raise ValueError("Gossip averages floating-point parameters, and this model has none")
        if any(p.device.type != "cpu" for p in layout.params):
            raise ValueError(
                "Gossip exchanges parameters from host memory; this model has parameters on "
                f"{sorted({str(p.device) for p in layout.params})}. HINT: keep the model on the CPU."
            )
        metrics = StepMetrics(topo.rank, self.metrics_path or default_metrics_path(topo))
        mesh = Mesh(dp=topo.world_size, topology=topo)
        job = GossipJob(model, optimizer, loss_fn, mesh, self.config, layout, metrics)
        if topo.is_distributed:
            job._connect()
        atexit.register(job.close)
        return job


document_options(GossipConfig, GossipConfig)
document_options(Gossip, GossipConfig)


class GossipJob(Job):
    """A replica trained by gossip (a `loom.job.Job`): `train_step`, `eval_step`, `state_dict`, plus
    `comm_stats`, `paused` and `close`. ``replicas_agree`` and ``replicated_state`` are False."""

    replicas_agree = False
    replicated_state = False

    def __init__(self, module, optimizer, loss_fn, mesh: Mesh, config, layout, metrics) -> None:
        self.module: nn.Module = module
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.topology: Topology = mesh.topology
        self.config: GossipConfig = config
        self.layout: ParameterLayout = layout
        self.metrics: StepMetrics = metrics
        self.step = 0
        """Optimizer steps this replica took."""
        rank, world = self.topology.rank, self.topology.world_size
        self.choice = PeerChoice(config.peers, rank, world, config.seed)
        self.attempts = 0
        """Exchanges this worker was due to make."""
        self.joined_from: int | None = None
        """The peer whose parameters this worker copied when it joined a running job."""
        self.distance: dict[int, float] = {}
        """L2 distance between this replica's and each peer's parameters at their last exchange."""
        self.node: PeerNode | None = None
        self._passed_over: dict[int, int] = {}
        self._addresses: dict[int, str] = {}
        self._store: Any = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._stopping = False
        self._failure: BaseException | None = None
        self._service: threading.Thread | None = None
        self._recorded = (0, 0)

    # -- set-up ------------------------------------------------------------------------------------------------
    def _key(self, what: str, rank: int) -> str:
        return f"loom/gossip/{self.config.namespace}/{what}/{rank}"

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
        self._store = dist.distributed_c10d._get_default_store()
        joins = self._store.add(self._key("joins", topo.rank), 1)
        self.node = PeerNode(
            topo.rank, topo.world_size, secret, self.layout.nbytes, self.layout.fingerprint,
            self._serve, self._address_of,
        )  # fmt: skip
        self._store.set(self._key("addr", topo.rank), self.node.address)
        if joins == 1:
            keys = [self._key("addr", r) for r in range(topo.world_size)]
            self._store.wait(keys, datetime.timedelta(seconds=cfg.setup_timeout_s))
            if cfg.same_start:
                with torch.no_grad():
                    for p in self.layout.params:
                        dist.broadcast(p.data, src=0)
        else:
            self._join()
        self._idle.set()
        self._service = threading.Thread(target=self._serve_between_steps, daemon=True)
        self._service.start()

    def _address_of(self, peer: int, refresh: bool) -> str | None:
        if refresh or peer not in self._addresses:
            # A restarted peer listens on a new port; a store that is gone leaves the last address known.
            with contextlib.suppress(RuntimeError, OSError, ValueError):
                self._addresses[peer] = bytes(self._store.get(self._key("addr", peer))).decode()
        return self._addresses.get(peer)

    def _join(self) -> None:
        """Copy the parameters of the first live peer in this worker's order of asking."""
        assert self.node is not None
        rank, world = self.topology.rank, self.topology.world_size
        nearest = [(rank + 1) % world, (rank - 1) % world, *((rank + d) % world for d in range(2, world))]
        order = list(dict.fromkeys(nearest))  # right neighbour, left, then the others
        for peer in order:
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

    # -- the exchange ------------------------------------------------------------------------------------------
    def _serve(self, kind: int, peer: int, theirs: torch.Tensor | None) -> torch.Tensor | None:
        """Answer a peer (in the thread that pumps): our values; for EXCHANGE also take the pair's mean."""
        mine = self.layout.pack()
        if not self.layout.finite(mine) or (theirs is not None and not self.layout.finite(theirs)):
            return None
        if kind == EXCHANGE:
            assert theirs is not None
            self._average(peer, theirs, mine, serving=True)
        return mine

    def _average(self, peer: int, theirs: torch.Tensor, sent: torch.Tensor, serving: bool) -> None:
        """Set the parameters to ``(theirs + sent) / 2``, plus what changed here since ``sent`` was packed
        (nothing on the serving side, which packed it just now), and note the pair's distance."""
        squares = 0.0
        with torch.no_grad():
            for i, p in enumerate(self.layout.params):
                a, b = self.layout.view(sent, i), self.layout.view(theirs, i)
                mean = (b + a) / 2
                p.copy_(mean if serving else mean + (p - a))
                squares += float((a.double() - b.double()).square().sum())
        self.distance[peer] = math.sqrt(squares)

    def _gossip(self) -> None:
        assert self.node is not None
        self.attempts += 1
        peer = None
        for _ in range(self.topology.world_size - 1):
            candidate = self.choice.next()
            if self._passed_over.get(candidate, 0) < self.attempts:
                peer = candidate
                break
        if peer is None:
            return
        sent = self.layout.pack()
        if not self.layout.finite(sent):
            return  # a diverged replica keeps its values to itself

        def merge(theirs: torch.Tensor) -> None:  # now, or later if the answer is late
            self._average(peer, theirs, sent, serving=False)

        outcome = self.node.request(peer, EXCHANGE, sent, self.config.deadline_s, merge)
        if outcome in ("late", "unreachable"):
            self._passed_over[peer] = self.attempts + self.config.retry_after

    # -- service thread ----------------------------------------------------------------------------------------
    def _serve_between_steps(self) -> None:
        while not self._stopping:
            if not self._idle.wait(0.5):
                continue
            with self._lock:
                if self._stopping or not self._idle.is_set() or self.node is None:
                    continue
                try:
                    self.node.pump(0.25)
                except BaseException as error:  # handed to the training thread at its next step
                    self._failure = error
                    return

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No peer changes the parameters inside this block (the service thread waits)."""
        self._idle.clear()
        if self.node is not None:
            self.node.wake()
        with self._lock:
            try:
                yield
            finally:
                self._idle.set()

    # -- the job contract --------------------------------------------------------------------------------------
    def train_step(self, batch: Any) -> float:
        """One local optimizer step on this worker's share, then (every ``every`` steps) one exchange. Returns
        THIS replica's mean loss on its share (0.0 for an empty share), not a global-batch loss: there is no
        collective to reduce it. A non-finite loss or gradient is not applied (``last_step_skipped``)."""
        check_batch_layout(batch, self)
        if self._failure is not None:
            raise RuntimeError(f"rank {self.topology.rank}: gossip service thread failed") from self._failure
        started = time.perf_counter()
        inputs, targets = split_batch(batch)
        local = batch_len(inputs)
        with self.paused():
            if self.node is not None:
                self.node.pump(0.0)
            loss_value = self._local_step(inputs, targets, local)
            self.step += 1
            exchanged = time.perf_counter()
            if self.node is not None and self.step % self.config.every == 0:
                self._gossip()
            comm_s = time.perf_counter() - exchanged
            sent, received = self._record_traffic()
        total = int(getattr(batch, "global_size", local * self.topology.world_size))
        self.metrics.record(
            self.step, time.perf_counter() - started, local, total, loss_value, comm_s=comm_s,
            bytes_sent=sent, bytes_received=received, skipped=True if self.last_step_skipped else None,
        )  # fmt: skip
        return loss_value

    def _local_step(self, inputs: Any, targets: torch.Tensor, local: int) -> float:
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_step_skipped = False
        if not local:
            return 0.0
        loss = self.loss_fn(self.module(inputs), targets)
        value = float(loss.detach())
        if math.isfinite(value):
            loss.backward()
            if gradients_finite([p.grad for p in self.module.parameters()]):
                self.optimizer.step()
                return value
        self.optimizer.zero_grad(set_to_none=True)
        self.last_step_skipped = True
        return value

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

    def eval_step(self, batch: Any, metrics: dict[str, MetricFn] | None = None) -> dict[str, float]:
        """The loss (and ``metrics``) of each replica's own parameters on its share, summed over the shares:
        the same on every rank. Collective (an all-reduce of a few numbers): every worker calls it."""
        check_batch_layout(batch, self)
        inputs, targets = split_batch(batch)
        fns: dict[str, Callable] = {"loss": self.loss_fn, **(metrics or {})}
        local = batch_len(inputs)
        sums = torch.zeros(len(fns) + 1, dtype=torch.float64)
        sums[-1] = local
        with self.paused(), torch.no_grad():
            was_training = self.module.training
            self.module.eval()
            try:
                if local:
                    outputs = self.module(inputs)
                    for i, fn in enumerate(fns.values()):
                        sums[i] = float(fn(outputs, targets)) * local
            finally:
                self.module.train(was_training)
        if self.topology.is_distributed:
            dist.all_reduce(sums)
        if sums[-1] == 0:
            raise ValueError("eval_step got a global batch of 0 samples (every share is empty)")
        return {name: float(sums[i] / sums[-1]) for i, name in enumerate(fns)}

    def state_dict(self) -> dict[str, Any]:
        """This replica's model, optimizer, step and peer choice (tensors and numbers)."""
        with self.paused():
            return {
                "model": self.module.state_dict(),
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
        """Numbers for step records and reports: this transport's bytes and exchanges by outcome (see
        `loom.comm.peer.PeerStats`), ``spread`` (the largest distance to a peer at the last exchange with it),
        ``last_peer`` / ``joined_from`` (-1: none) and ``step``."""
        stats: dict[str, float] = dict(self.node.stats.as_dict()) if self.node is not None else {}
        stats["spread"] = max(self.distance.values(), default=0.0)
        stats["joined_from"] = -1 if self.joined_from is None else self.joined_from
        stats["step"] = self.step
        return stats

    def close(self) -> None:
        """Stop serving; wait (at most ``deadline_s``) for this worker's late answers; close the sockets."""
        if self._stopping:
            return
        self._stopping = True
        self._idle.set()
        if self.node is not None:
            self.node.wake()
        if self._service is not None:
            self._service.join(timeout=5.0)
        with self._lock:
            if self.node is not None:
                self.node.close(drain_s=self.config.deadline_s)
                self._record_traffic()
        self.metrics.close()
