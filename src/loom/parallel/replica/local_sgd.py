"""Local SGD: every replica steps on its own share; every ``sync_every`` steps the replicas are averaged.

The idea (Stich, ICLR 2019; Lin et al., ICLR 2020; torchft's ``LocalSGD``) and usage:
``docs/strategies/local-sgd-diloco.md``. The average is weighted by the samples each replica trained on since the
last one (`_replica_sync`), over the parameters and the floating-point buffers; the optimizer's state stays each
replica's own. With ``H = 1`` and plain SGD (no momentum) it *is* synchronous data parallelism: the weighted
average of ``p - lr * g_r`` is ``p - lr * sum_r n_r/N g_r`` (with momentum, only close when shares are uneven).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.comm import ALGORITHMS
from loom.comm import all_reduce as comm_all_reduce
from loom.config_docs import document_options
from loom.errors import check_choice, check_int
from loom.job import load_replicated_state, replicated_state
from loom.parallel._setup import LossFn
from loom.parallel.replica._replica_sync import (
    ReplicaJob,
    ReplicaStrategy,
    flatten,
    synced_tensors,
)
from loom.train.engine import ShareOptions

__all__ = ["LocalSGD", "LocalSGDConfig", "LocalSGDJob"]


@dataclass(frozen=True)
class LocalSGDConfig(ShareOptions):
    """How often and how `LocalSGD` averages the replicas."""

    sync_every: int = 8
    """Optimizer steps between two averages (``H``); 1 averages after every step."""
    allreduce: str = "auto"
    """The all-reduce algorithm of the average (see `loom.comm.all_reduce`): ``native``, ``ring``,
    ``driver``, ``shm``, ``hierarchical`` or ``auto``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sync_every", self.sync_every, hint="1 averages after every step, 8 every eighth step.")
        check_choice("allreduce", self.allreduce, ALGORITHMS)


class LocalSGD(ReplicaStrategy):
    """Strategy: replicas step on their own shares and average their parameters every ``sync_every`` steps."""

    config_type = LocalSGDConfig

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> LocalSGDJob:
        """Check that the replicas hold the same model and optimizer, start them from rank 0's parameters."""
        return self._setup(LocalSGDJob, model, optimizer, loss_fn)


document_options(LocalSGDConfig, LocalSGDConfig)
document_options(LocalSGD, LocalSGDConfig)


class LocalSGDJob(ReplicaJob):
    """A model set up for local SGD (the `loom.job.Job` contract; its state is per rank)."""

    config: LocalSGDConfig

    def _start(self) -> None:
        self.samples = 0
        """Samples this replica trained on since the last average."""
        self.global_samples = 0
        """Samples the whole job trained on since the last average (the same on every rank)."""
        self.averages = 0
        """Averages taken by this job object (a counter for tests and reports; not checkpointed)."""

    def _count_samples(self, local: int, total: int) -> None:
        self.samples += local
        self.global_samples += total

    def _exchange(self) -> None:
        if self.step % self.config.sync_every == 0:
            self.synchronize()

    def synchronize(self) -> None:
        """Average the replicas now, weighted by their samples since the last average (collective: every rank
        calls it; nothing to do when no step was applied since). Afterwards every replica holds the same
        parameters and floating-point buffers. Under heal: at a round boundary only (`RoundCommit`)."""
        if self.rounds is not None:
            self.rounds.refuse_mid_round(self)
        params, buffers = synced_tensors(self.module)
        tensors = params + buffers
        if not tensors or not self.global_samples:  # no step applied since the last average: still equal
            return
        flat = flatten(tensors, self.samples / self.global_samples)
        if self._fault is not None:  # the other members are inside the all-reduce by now
            self._fault(self.step, "during")
        with self.collective("replica average all-reduce"):
            comm_all_reduce(flat, op="sum", algorithm=self.allreduce, group=self.axis.group)
        with torch.no_grad():  # the average back into the tensors it was flattened from
            for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                t.copy_(piece.view_as(t))
        self.samples = self.global_samples = 0
        self.averages += 1

    def state_dict(self) -> dict[str, Any]:
        """This replica's model, optimizer, step, and its samples since the last average."""
        return {**replicated_state(self), "samples": self.samples, "global_samples": self.global_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_replicated_state(self, state)
        self.samples = int(state["samples"])
        self.global_samples = int(state["global_samples"])
        self._state_loaded()
