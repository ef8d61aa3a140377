"""The job contract: what every strategy's ``setup()`` returns, and all that `loom.fit` relies on.

Usage and the user's view of the contract: docs/concepts.md ("Job", "Data axis"). Everything around training
(`loom.fit`, its checkpoints and restarts, desync checks, step records, reports) uses only what `Job` declares
here, never a strategy's class. Every strategy's job subclasses `loom.train.engine.Engine`, which implements
`train_step` and `eval_step` once for all (a strategy supplies the engine's hooks), sets the attributes in its
``__init__`` and implements `state_dict` and `load_state_dict`.

The global batch is sharded over the `Mesh`'s ``dp`` axis only (`Job.data_topology`), because the processes of
one model replica (pipeline stages, tensor shards: the other axes) must see the same samples; `check_batch_layout`
refuses a batch cut for another layout. `state_dict` is this rank's part of one consistent checkpoint: the same on
every rank when ``replicated_state`` (rank 0's is written), else every rank's part is written and the checkpoint
resumes only at the world size and mesh that wrote it, unless the job ``reshards``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from loom.data.loader import LazyBatch
from loom.data.loader import loader as make_loader
from loom.mesh import Mesh
from loom.topology import Topology

if TYPE_CHECKING:
    from loom.observe.metrics import StepMetrics

__all__ = ["Job", "MetricFn", "check_batch_layout"]

MetricFn = Callable[[Any, torch.Tensor], torch.Tensor]
"""``fn(outputs, targets)``: a metric averaged over the batch (e.g. accuracy), as `Job.eval_step` takes it."""


class Job(abc.ABC):
    """A model set up by a strategy for this process: train, evaluate, load data, save and restore.

    Attributes every job sets: ``topology`` (this process in the whole job), ``mesh`` (its axes: ``dp``, and
    ``pp``/``tp`` for model-parallel jobs), ``module`` (the model as this process holds it: the whole model, a
    stage, or tensor shards), ``optimizer``, ``step`` (optimizer steps taken), ``metrics`` (step records) and
    ``replicated_state``.
    """

    topology: Topology
    mesh: Mesh
    module: nn.Module
    optimizer: torch.optim.Optimizer
    step: int
    replicated_state: bool
    """True when `state_dict` is the same on every rank (rank 0 saves it once); False when each rank's differs."""

    data_axis = "dp"
    """The mesh axis the global batch is sharded over."""
    last_step_skipped = False
    """True when the last `train_step` applied no update (a non-finite loss or gradient on some rank, the same
    verdict on every rank); strategies with such a guard set it at every step, `loom.fit` counts it."""
    metrics: StepMetrics
    """This process's step records (`loom.observe.metrics`: step time, samples, phases); `loom.fit`'s trackers
    read the step's throughput from them."""
    loss_scope = "global"
    """What `train_step` returns. ``"global"``: the global-batch mean loss, the same on every rank (synchronous
    strategies). ``"replica"``: this replica's own mean loss on its share, which differs between ranks (Gossip and
    asynchronous parameter servers, whose replicas hold different models and never reduce a loss per step);
    `loom.fit`'s result and progress line say which."""
    reshards = False
    """True when a job whose state is not replicated resumes at another world size: `loom.fit` then hands
    `load_resharded` every rank's saved part (`ShardedDataParallel`); False refuses another world size."""
    replicas_agree = True
    """True when the replicas along the data axis hold bitwise-equal parameters after every step (synchronous
    strategies); `loom.fit`'s ``desync_every`` checks it. Strategies whose replicas drift apart set False."""
    fetches_shares = False
    """True when the job takes a `loom.data.LazyBatch` (a global batch not loaded, what its `loader` yields) and
    fetches its own share at the step: DataParallel, LocalSGD and DiLoCo under heal. Others refuse one."""

    # -- the four methods a strategy implements ---------------------------------------------------------------
    @abc.abstractmethod
    def train_step(self, batch: Any) -> float:
        """One optimizer step on the global batch ``batch`` is this process's share of; returns the global-batch
        mean loss, the same on every rank (or, where ``loss_scope`` is ``"replica"``, this replica's own)."""

    @abc.abstractmethod
    def eval_step(self, batch: Any, metrics: dict[str, MetricFn] | None = None) -> dict[str, float]:
        """The global-batch mean loss (``"loss"``) and any extra ``metrics``, in eval mode, without a step.
        Collective: every rank calls it."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's part of one consistent checkpoint (tensors, numbers, strings, lists and dicts)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (on the same rank, for jobs whose state is not replicated)."""

    # -- shared by every job ----------------------------------------------------------------------------------
    @property
    def data_topology(self) -> Topology:
        """The replicas of the data axis as a `Topology`: what `loader` shards over."""
        return self.mesh.data_topology()

    def loader(
        self,
        dataset: Dataset,
        global_batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        **options: Any,
    ) -> Any:
        """This process's share of each global batch of ``dataset``, sharded over the job's data axis (see
        `loom.data.loader` for the order, the shares and the state; ``options`` are passed on to it)."""
        options.setdefault("device", self._batch_device())
        return make_loader(
            dataset, global_batch_size, shuffle, seed, drop_last, topology=self.data_topology, **options
        )

    def _batch_device(self) -> torch.device | None:
        """Where this process's part of the model is (its first parameter's device): a CUDA one gets each share
        copied there ahead of the step (`loom.data.prefetch`). Not the topology's device: a job may keep its
        model elsewhere (a parameter server's worker keeps the user's CPU model on a GPU host)."""
        return next((parameter.device for parameter in self.module.parameters()), None)

    def memory(self) -> dict[str, int]:
        """This process's tensor bytes by category: ``parameters``, ``gradients``, ``optimizer``, ``other``,
        ``state`` (the first three) and ``total``, counted over every live tensor (`loom.observe.memory`: call it
        between steps, not in them; the step records carry its cheap part every ``memory_every`` steps)."""
        # imported here: observe imports torch only, like this module
        from loom.observe.memory import live_tensor_bytes

        return live_tensor_bytes(self.module, getattr(self, "optimizer", None))

    def load_resharded(self, read_part: Callable[[int], Any], written_by: int) -> None:
        """Restore a sharded checkpoint written by ``written_by`` ranks into this rank's share of the job, with
        ``read_part(r)`` the saved `state_dict` of rank ``r``; only jobs with ``reshards`` implement it."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot resume a checkpoint written at another world size ({written_by} "
            "processes). HINT: resume with the world size that wrote it."
        )

    def local_state_dict(self) -> dict[str, Any]:
        """Per-rank state kept beside a replicated `state_dict` (gradient compression's error feedback), restored
        at the same world size; none here."""
        return {}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `local_state_dict` returned on this rank."""
        del state  # nothing kept here; jobs with local state override both methods


def replicated_state(job: Job) -> dict[str, Any]:
    """The state of a job whose ranks hold the whole model and optimizer: the model's and the optimizer's
    ``state_dict`` and the step (DataParallel, healed or not, LocalSGD and DiLoCo's inner state)."""
    return {"model": job.module.state_dict(), "optimizer": job.optimizer.state_dict(), "step": job.step}


def load_replicated_state(job: Job, state: dict[str, Any]) -> None:
    """Restore what `replicated_state` returned."""
    job.module.load_state_dict(state["model"])
    job.optimizer.load_state_dict(state["optimizer"])
    job.step = int(state["step"])


def check_batch_layout(batch: Any, job: Job) -> None:
    """Refuse a `loom.data.loader` batch sharded for a data layout other than ``job``'s data axis.

    A batch that carries its layout (``shard_index``, ``shard_count``: the replica it was cut for and the number
    of replicas) must have been cut for this process's replica; plain tuples carry none and are checked by the
    strategies that can (model-parallel jobs compare sample fingerprints across a replica).
    """
    if isinstance(batch, LazyBatch) and not job.fetches_shares:
        raise TypeError(
            f"rank {job.topology.rank}: {type(job).__name__} was given a LazyBatch (a global batch not loaded, "
            "what job.loader yields under --on-worker-failure heal), and it does not fetch shares at the step. "
            "HINT: iterate this job's own job.loader(dataset, global_batch_size=...), or pass batch.load()."
        )
    count = getattr(batch, "shard_count", None)
    if count is None:
        return
    data = job.data_topology
    index = getattr(batch, "shard_index", None)
    if (index, count) != (data.rank, data.world_size):
        raise ValueError(
            f"rank {job.topology.rank}: this batch is share {index} of {count}, but the job shards data over its "
            f"'{job.data_axis}' axis of {data.world_size} replica(s) and this process belongs to replica "
            f"{data.rank} (mesh {job.mesh.shape.describe()}): the ranks of one model replica would train on "
            "different samples. HINT: build the loader with job.loader(dataset, global_batch_size, ...)."
        )
