"""DiLoCo: replicas train on their own for ``H`` steps, then an outer optimizer applies their averaged progress.

The papers (Douillard et al. 2023; Streaming DiLoCo's fragments, Douillard et al. 2025; OpenDiLoCo's int8 outer
all-reduce, Jaghouar et al. 2024) and usage: ``docs/strategies/local-sgd-diloco.md``. The pseudo-gradient is the
global copy minus the replica's local parameters; the outer optimizer steps the global copy with its average,
and every replica takes the result.

Fragment ``k`` (a contiguous run of parameters, balanced by size; fragment 0 also carries the floating-point
buffers, averaged, not stepped) is sent after the steps ``t`` with ``t % H == k * H / F``, so every parameter is
synchronized once every ``H`` steps. The pseudo-gradients are weighted by the samples each replica trained on
since the fragment's previous exchange, so with ``H = 1``, inner SGD and an outer SGD of lr 1, DiLoCo is
synchronous data parallelism. An exchange runs on a communication thread over a process group of its own while
the next ``overlap_steps`` inner steps run, and is applied after step ``t + overlap_steps`` exactly, so a run is
reproducible (and a resume bitwise: `DiLoCoJob.state_dict`); applying it keeps the replica's own progress since.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.comm import ALGORITHMS
from loom.comm.compression import INT8_CHUNK, accept_compression
from loom.comm.compression.replicas import SUM_SPECS, compressed_sum
from loom.comm.thread import CommThread
from loom.config_docs import document_options
from loom.errors import check_choice, check_int
from loom.job import load_replicated_state, replicated_state
from loom.parallel._setup import LossFn
from loom.parallel.consistency import check_same_model
from loom.parallel.replica._replica_sync import (
    ReplicaJob,
    ReplicaStrategy,
    flatten,
    synced_tensors,
)
from loom.train.engine import ShareOptions
from loom.train.heal_state import share_training_state

__all__ = ["DiLoCo", "DiLoCoConfig", "DiLoCoJob", "INT8_CHUNK", "split_fragments"]

WHY_NOT = {
    "topk": "its error feedback keeps a residual per gradient across steps; the outer exchange has none",
    "powersgd": "its error feedback and warm start keep state across steps; the outer exchange has none",
}
"""Why DiLoCo refuses the specs of the vocabulary it does not take."""
OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def default_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True)
class DiLoCoConfig(ShareOptions):
    """How `DiLoCo` synchronizes the replicas."""

    sync_every: int = 500
    """Inner steps between two synchronizations of each parameter (``H``; 500 in the paper)."""
    fragments: int = 1
    """Pieces of the model synchronized at staggered steps (``F``, streaming DiLoCo); must divide ``sync_every``."""
    compression: str | None = None
    """The outer gradient on the wire: None (the parameters' dtype), ``"fp16"``, ``"bf16"`` or ``"int8"``
    (chunked scales); the specs of `loom.comm.compression` that keep no state across exchanges."""
    outer_optimizer: OuterFactory | None = None
    """``fn(params) -> torch.optim.Optimizer`` over the global copy; None: SGD, lr 0.7, Nesterov momentum 0.9."""
    overlap_steps: int | None = None
    """Inner steps an exchange overlaps before its result is applied (0: at once, blocking); None: 1 when
    ``fragments > 1`` (streaming), else 0. Must be below ``sync_every``."""
    allreduce: str = "auto"
    """The all-reduce algorithm of the outer gradient (`loom.comm.all_reduce`); ``int8`` all-gathers instead."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sync_every", self.sync_every, hint="the paper synchronizes every 500 inner steps.")
        check_int("fragments", self.fragments, hint="1 synchronizes the whole model at once.")
        h, f = self.sync_every, self.fragments
        if h % f:
            raise ValueError(
                f"sync_every={h} is not a multiple of fragments={f}: fragment k is synchronized after the steps "
                f"where step % {h} == k * {h} / {f}. HINT: use sync_every={-(-h // f) * f} or a number of "
                f"fragments that divides {h}."
            )
        # the canonical spec; one of the vocabulary DiLoCo cannot use is refused by name, with the reason
        object.__setattr__(
            self, "compression", accept_compression(self.compression, "DiLoCo", SUM_SPECS, WHY_NOT)
        )
        if self.outer_optimizer is not None and (
            isinstance(self.outer_optimizer, torch.optim.Optimizer) or not callable(self.outer_optimizer)
        ):
            raise TypeError(
                f"outer_optimizer must be a function of the global copy's parameters, got "
                f"{type(self.outer_optimizer).__name__} (the global copy does not exist before setup). HINT: "
                "outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)."
            )
        tau = self.overlap
        if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau < h:
            raise ValueError(
                f"overlap_steps={self.overlap_steps!r} must be an int from 0 to sync_every - 1 = {h - 1}: an "
                f"exchange must be applied before its fragment's next one. HINT: 0 blocks, 1 overlaps one step."
            )
        check_choice("allreduce", self.allreduce, ALGORITHMS)
        if self.compression == "int8" and self.allreduce not in ("auto", "native"):
            raise ValueError(
                f"compression='int8' all-gathers the codes with the backend; it cannot be combined with "
                f"allreduce={self.allreduce!r}. HINT: leave allreduce at its default with int8."
            )

    @property
    def overlap(self) -> Any:
        """``overlap_steps`` with its default resolved."""
        if self.overlap_steps is None:
            return 1 if self.fragments > 1 and self.sync_every > 1 else 0
        return self.overlap_steps


class DiLoCo(ReplicaStrategy):
    """Strategy: inner steps per replica, every H steps an outer step on the mean pseudo-gradient."""

    config_type = DiLoCoConfig

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> DiLoCoJob:
        """Check the replicas agree (model, inner and outer optimizer), start them from rank 0's parameters."""
        return self._setup(DiLoCoJob, model, optimizer, loss_fn)


document_options(DiLoCoConfig, DiLoCoConfig)
document_options(DiLoCo, DiLoCoConfig)


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Cut tensors of ``sizes`` elements, in order, into ``fragments`` contiguous non-empty runs of indices
    whose element counts are as equal as the cuts allow."""
    if len(sizes) < fragments:
        raise ValueError(
            f"fragments={fragments} but the model has only {len(sizes)} parameter tensor(s). HINT: use at most "
            f"{len(sizes)} fragments."
        )
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    cuts, start = [], 0
    for k in range(1, fragments):
        target = ends[-1] * k / fragments
        allowed = range(start + 1, len(sizes) - (fragments - k) + 1)  # each run keeps at least one tensor
        start = min(allowed, key=lambda c: abs(ends[c - 1] - target))
        cuts.append(start)
    bounds = [0, *cuts, len(sizes)]
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass
class _Exchange:
    """One fragment's outer gradient on its way: sent after step ``launched``, applied after ``apply_at``."""

    fragment: int
    launched: int
    apply_at: int
    sent_from: list[torch.Tensor]
    """The fragment's local values when it was sent (empty without overlap): the base of the replica's own
    progress, which applying the result keeps."""
    pending: concurrent.futures.Future | None
    result: torch.Tensor | None = None


class DiLoCoJob(ReplicaJob):
    """A model set up for DiLoCo (the `loom.job.Job` contract; its state is per rank)."""

    config: DiLoCoConfig

    def _start(self) -> None:
        module, config, topology = self.module, self.config, self.topology
        self._params, self._buffers = synced_tensors(module)
        self.global_params = [p.detach().clone() for p in self._params]
        """The global copy: what the outer optimizer steps, the same on every rank."""
        self.outer_optimizer = (config.outer_optimizer or default_outer_optimizer)(self.global_params)
        if not isinstance(self.outer_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"outer_optimizer returned {type(self.outer_optimizer).__name__}, not an Optimizer"
            )
        self.fragments = split_fragments([p.numel() for p in self._params], config.fragments)
        """Indices into ``module.parameters()`` of each fragment's parameters."""
        names = [n for n, _ in module.named_parameters()]
        self.fragment_names = [[names[i] for i in run] for run in self.fragments]
        self._samples, self._global_samples = [0] * config.fragments, [0] * config.fragments
        self._in_flight: list[_Exchange] = []
        self.sync_log: list[tuple[int, int, int]] = []
        """``(fragment, step sent, step applied)`` of every exchange applied by this job object."""
        self._sync_group: Any = None
        self._thread: CommThread | None = None
        # its own group: the training thread's collectives may run meanwhile (under heal no exchange overlaps a
        # step: a round's runs over the epoch's group, `axis.group`). A topology that brings its own process group
        # (ranks as threads) has no second one: the exchanges share it, right only with no step beside them.
        if topology.is_distributed and self.quorum is None:
            own = topology.process_group
            if own is not None and config.overlap != 0:
                raise ValueError(
                    f"DiLoCo(overlap_steps={config.overlap}) overlaps exchanges with steps on a group of their own; "
                    "this topology has one process group. HINT: overlap_steps=0, or join with loom.init()"
                )
            check_same_model(
                module, topology.rank, topology.world_size, topology.group, optimizer=self.outer_optimizer
            )
            self._sync_group = dist.new_group(ranks=list(range(topology.world_size))) if own is None else own
            self._thread = CommThread(f"loom-diloco-{topology.rank}")

    def _count_samples(self, local: int, total: int) -> None:
        for k in range(len(self.fragments)):
            self._samples[k] += local
            self._global_samples[k] += total

    def _exchange(self) -> None:
        h, f = self.config.sync_every, self.config.fragments
        for k in range(f):
            if self.step % h == k * (h // f):  # fragment k's turn (the module docstring)
                self._send(k, self.config.overlap)
        for entry in [e for e in self._in_flight if e.apply_at == self.step]:
            self._apply_exchange(entry)

    def _fragment_tensors(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Local and global tensors of fragment ``k`` (fragment 0 adds the buffers, averaged as they are)."""
        local = [self._params[i] for i in self.fragments[k]]
        held = [self.global_params[i] for i in self.fragments[k]]
        return (local + self._buffers, held) if k == 0 else (local, held)

    def _pad_before_buffers(self, k: int) -> int:
        """Zeros between fragment ``k``'s pseudo-gradients and the buffers it carries, so that under int8 no chunk
        (one scale) holds both: a buffer's values (a running variance near 1) would set the scale of small
        pseudo-gradients sharing its chunk and round them to 0."""
        if self.config.compression != "int8" or k != 0 or not self._buffers:
            return 0
        return -sum(self._params[i].numel() for i in self.fragments[k]) % INT8_CHUNK

    def _send(self, k: int, overlap: int) -> None:
        local, held = self._fragment_tensors(k)
        trained, total = self._samples[k], self._global_samples[k]
        weight = trained / total if total else 1.0 / self.axis.size
        pieces = [g - p.detach() for g, p in zip(held, local, strict=False)]
        pad = self._pad_before_buffers(k)
        pieces += ([torch.zeros(pad, dtype=torch.float32)] if pad else []) + local[len(held) :]
        flat = flatten(pieces, weight)
        sent_from = [t.detach().clone() for t in local] if overlap else []
        group = self._sync_group if self._sync_group is not None else self.axis.group
        if self._fault is not None:  # the other members are inside the exchange by now
            self._fault(self.step, "during")
        args = (flat, self.config.compression, self.allreduce, group)
        if self._thread is not None:
            pending = self._thread.submit(compressed_sum, *args)
        else:
            pending = concurrent.futures.Future()
            pending.set_result(compressed_sum(*args))
        self._in_flight.append(_Exchange(k, self.step, self.step + overlap, sent_from, pending))
        self._samples[k] = self._global_samples[k] = 0

    def _wait(self, entry: _Exchange) -> torch.Tensor:
        if entry.result is None:
            op = f"outer exchange of fragment {entry.fragment} (sent after step {entry.launched})"
            with self.collective(op):
                try:
                    entry.result = entry.pending.result()  # type: ignore[union-attr]
                except Exception as error:
                    raise RuntimeError(f"rank {self.topology.rank}: {op} failed: {error}") from error
            entry.pending = None
        return entry.result

    def _apply_exchange(self, entry: _Exchange) -> None:
        """The outer step on the fragment's global copy, then the local values from it."""
        averaged = self._wait(entry)
        local, held = self._fragment_tensors(entry.fragment)
        sizes, n = [t.numel() for t in local], len(held)
        views = list(averaged.split([*sizes[:n], self._pad_before_buffers(entry.fragment), *sizes[n:]]))
        del views[n]  # the zeros before the buffers (empty without int8)
        self.outer_optimizer.zero_grad(set_to_none=True)
        for g, piece in zip(held, views, strict=False):
            g.grad = piece.view_as(g).to(g.dtype)
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        new = held + [v.view_as(b) for v, b in zip(views[len(held) :], local[len(held) :], strict=True)]
        with torch.no_grad():
            for i, (target, value) in enumerate(zip(local, new, strict=True)):
                if entry.sent_from:  # keep this replica's progress since the exchange was sent
                    target.add_(value.to(target.dtype) - entry.sent_from[i])
                else:
                    target.copy_(value)
        self._in_flight.remove(entry)
        self.sync_log.append((entry.fragment, entry.launched, self.step))

    def synchronize(self) -> None:
        """Apply every exchange in flight now, then a blocking outer step on every fragment trained since it was
        last sent: afterwards every replica holds the global copy. Collective; meant for the end of training
        (it applies exchanges early and adds outer steps, so a run that calls it is not an uninterrupted one).
        Under heal: at a round boundary only (`loom.parallel.replica.round_commit.RoundCommit`)."""
        if self.rounds is not None:
            self.rounds.refuse_mid_round(self)
        for entry in list(self._in_flight):
            self._apply_exchange(entry)
        for k in range(len(self.fragments)):
            # the same on every rank; a fragment just synchronized has no progress
            if self._global_samples[k]:
                self._send(k, 0)
                self._apply_exchange(self._in_flight[-1])

    def close(self) -> None:
        """Wait for the exchanges in flight and stop the communication thread."""
        for entry in self._in_flight:
            self._wait(entry)
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    # -- state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This replica's inner state, the global copy, the outer optimizer, the sample counts and every
        exchange in flight (its result waited for)."""
        in_flight = [
            {"fragment": e.fragment, "launched": e.launched, "apply_at": e.apply_at,
             "sent_from": e.sent_from, "result": self._wait(e)}
            for e in self._in_flight
        ]  # fmt: skip
        return {
            **replicated_state(self),
            "global": list(self.global_params),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "samples": list(self._samples),
            "global_samples": list(self._global_samples),
            "in_flight": in_flight,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_replicated_state(self, state)
        saved = state["global"]
        if len(saved) != len(self.global_params):
            raise ValueError(
                f"rank {self.topology.rank}: the checkpoint's global copy holds {len(saved)} tensors, this "
                f"model {len(self.global_params)}. HINT: resume with the model that wrote it."
            )
        with torch.no_grad():
            for g, s in zip(self.global_params, saved, strict=True):
                g.copy_(s)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self._samples = [int(n) for n in state["samples"]]
        self._global_samples = [int(n) for n in state["global_samples"]]
        for e in self._in_flight:
            self._wait(e)
        self._in_flight = [
            _Exchange(int(e["fragment"]), int(e["launched"]), int(e["apply_at"]), list(e["sent_from"]), None,
                      e["result"])
            for e in state["in_flight"]
        ]  # fmt: skip
        self._state_loaded()

    def _share_more(self, source: int, load: bool) -> None:
        """Under heal: the global copy and the outer optimizer's state travel with the model."""
        holder = nn.Module()  # its buffers are the global copy's tensors themselves: broadcast in place
        for i, tensor in enumerate(self.global_params):
            holder.register_buffer(f"t{i}", tensor)
        quorum = self.quorum
        assert quorum is not None and quorum.group is not None
        share_training_state(
            holder, self.outer_optimizer, self.step, source, quorum.index, quorum.group, load
        )
