"""The check every strategy's ``setup(model, optimizer, loss_fn)`` makes before it touches the model."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loom.errors import StartRefused
from loom.observe.metrics import StepMetrics
from loom.topology import Topology, current
from loom.train.batch import LossCall
from loom.train.options import config_from

__all__ = [
    "HEALS",
    "LossFn",
    "SURVIVE_LOST_WORKER",
    "Strategy",
    "check_failure_policy",
    "check_setup_arguments",
    "failure_policy",
    "joins_healing",
    "step_metrics",
]


LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
"""``loss_fn(outputs, targets)``: the plain loss convention (`loom.LossCall` has the others)."""


def step_metrics(topo: Topology, path: str | None, kind: type[StepMetrics] = StepMetrics) -> StepMetrics:
    """This process's step records (a ``kind``), appended to ``path``; by default, under ``loom run``, to
    ``RUN_DIR/metrics/rank<r>.jsonl`` (under heal ``rank<r>.heal<g>.jsonl`` for a rank's g-th replacement)."""
    run_dir, gen = os.environ.get("LOOM_RUN_DIR"), int(os.environ.get("LOOM_HEAL_GENERATION", "0") or 0)
    default = f"{run_dir}/metrics/rank{topo.rank}{f'.heal{gen}' if gen else ''}.jsonl" if run_dir else None
    return kind(topo.rank, path or default)


SURVIVE_LOST_WORKER = "Gossip, ParameterServer(mode='async') or ParameterServer(mode='ssp')"
"""The strategies whose surviving ranks finish the job when one dies (``--on-worker-failure continue``)."""


HEALS = "DataParallel, LocalSGD, DiLoCo"
"""The strategies that heal a lost worker (``--on-worker-failure heal``): a replacement copies a live peer."""


def _why_no_heal(strategy: str) -> str:
    """Why ``strategy`` cannot heal, in the words a user can check against what the strategy keeps where."""
    if strategy.startswith("ShardedDataParallel"):
        return ("each rank holds the only copy of its shard of the optimizer state (and, at zero=2 and 3, of the "
                "gradients and parameters), so a lost rank's shard is nowhere to heal from")  # fmt: skip
    if strategy.startswith(("Pipeline", "TensorParallel", "Hybrid", "a model-parallel job")):
        return (
            "each rank holds the only copy of its stage or shard of the model, so a lost rank's part is lost"
        )
    return "its replacement would need a membership that changes between steps"


def failure_policy(backend: str) -> str:
    """The launcher's ``--on-worker-failure`` policy (``LOOM_ON_WORKER_FAILURE``: stop, continue or heal) for a
    job over a topology of ``backend``; "stop" for ``backend="none"``, whatever the launcher's: a one-process
    reference or evaluation model inside the launched job has no peer to lose (and under heal would re-enter
    this process's own quorum membership)."""
    return "stop" if backend == "none" else os.environ.get("LOOM_ON_WORKER_FAILURE", "stop")


def joins_healing(backend: str) -> bool:
    """Whether a job over a topology of ``backend`` joins the healing quorum (`failure_policy` is heal)."""
    return failure_policy(backend) == "heal"


def check_failure_policy(
    strategy: str, survives_lost_worker: bool, heals: bool = False, *, backend: str
) -> None:
    """Refuse to start ``strategy`` under the `failure_policy` of its ``backend`` when it cannot keep it: heal
    unless ``heals``; continue unless ``survives_lost_worker`` (the survivors of a strategy whose ranks all meet
    in its exchanges would crash at the next one, with nothing finished). Checked before any collective, the same
    on every rank."""
    policy = failure_policy(backend)
    if policy == "heal" and not heals:
        raise StartRefused(
            f"--on-worker-failure heal: {strategy} cannot heal a lost worker ({_why_no_heal(strategy)}). HINT: "
            f"use a strategy that heals: {HEALS}; or --on-worker-failure stop with --max-restarts N"
        )
    if policy != "continue" or survives_lost_worker:
        return
    raise StartRefused(
        f"--on-worker-failure continue: {strategy} cannot go on without a lost worker (every rank takes part in "
        "its exchanges, so the survivors would fail at the next one). HINT: use --on-worker-failure stop (the "
        f"default) with --max-restarts N to restart the group after a failure, or a strategy whose survivors "
        f"finish: {SURVIVE_LOST_WORKER}"
    )


def check_setup_arguments(
    model: Any,
    optimizer: Any,
    loss_fn: Any,
    *,
    strategy: str = "this strategy",
    conventions: bool = False,
    survives_lost_worker: bool = False,
    heals: bool = False,
    backend: str,
) -> LossCall:
    """Refuse arguments of the wrong type, and an optimizer holding parameters that are not the model's
    (it would step tensors the strategy never synchronizes); return the loss convention (`LossCall`).
    Refuse a failure policy the strategy cannot keep over a topology of ``backend`` (`check_failure_policy`).

    ``conventions``: whether ``strategy`` runs every `LossCall` convention (one call to
    `loom.train.batch.forward_loss` on the whole model); strategies that call the loss elsewhere (a
    pipeline's last stage) take the plain ``loss_fn(model(inputs), targets)`` only and refuse the others here.
    """
    check_failure_policy(strategy, survives_lost_worker, heals, backend=backend)
    if not isinstance(model, nn.Module):
        raise TypeError(f"setup() expects an nn.Module as model, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"setup() expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    call = LossCall.of(loss_fn)
    if not conventions and not call.plain:
        raise ValueError(
            f"{strategy} calls the model as model(inputs) and the loss as loss_fn(outputs, targets); it cannot "
            f"run {call.describe()}. HINT: pass a loss_fn(outputs, targets) (wrap the model so that it takes one "
            "inputs argument), or use loom.DataParallel, which runs every loom.LossCall convention."
        )
    owned = {id(p) for p in model.parameters()}
    stray = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in owned]
    if stray:
        raise ValueError(
            f"the optimizer holds a parameter of shape {tuple(stray[0].shape)} that is not in the model. "
            "HINT: build the optimizer from model.parameters() of the model passed to setup()."
        )
    return call


class Strategy:
    """The constructor the strategies share: options into the config dataclass ``config_type``, checked now."""

    config_type: Any

    def __init__(
        self,
        config: Any = None,
        *,
        topology: Topology | None = None,
        metrics_path: str | None = None,
        observe: bool = True,
        **options: Any,
    ) -> None:
        self.config = config_from(self.config_type, config, options, type(self).__name__)
        self.topology = topology
        self.metrics_path = metrics_path
        self.observe = observe
        """Time each step's phases, count bytes, detect stragglers, trace (`loom.observe`); off: no records."""

    def _topology(self) -> Topology:
        """The topology given, or the one `loom.init` joined."""
        return self.topology if self.topology is not None else current()
