"""The check every strategy's ``setup(model, optimizer, loss_fn)`` makes before it touches the model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.strategies._batch import LossCall

__all__ = ["check_setup_arguments"]


def check_setup_arguments(
    model: Any, optimizer: Any, loss_fn: Any, *, strategy: str = "this strategy", conventions: bool = False
) -> LossCall:
    """Refuse arguments of the wrong type, and an optimizer holding parameters that are not the model's
    (it would step tensors the strategy never synchronizes); return the loss convention (`LossCall`).

    ``conventions``: whether ``strategy`` runs every `LossCall` convention (one call to
    `loom.strategies._batch.forward_loss` on the whole model); strategies that call the loss elsewhere (a
    pipeline's last stage) take the plain ``loss_fn(model(inputs), targets)`` only and refuse the others here.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"setup() expects an nn.Module as model, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"setup() expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    call = _loss_call(loss_fn)
    if not conventions and not call.plain:
        raise ValueError(
            f"{strategy} calls the model as model(inputs) and the loss as loss_fn(outputs, targets); it cannot "
            f"run {call.describe()}. HINT: pass a loss_fn(outputs, targets) (wrap the model so that it takes one "
            "inputs argument), or use loom.DataParallel, which runs every loom.LossCall convention."
        )
    owned = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in the model. "
                    "HINT: build the optimizer from model.parameters() of the model passed to setup()."
                )
    return call


def _loss_call(loss_fn: Any) -> LossCall:
    if isinstance(loss_fn, LossCall):
        return loss_fn
    if loss_fn is None:
        return LossCall(None)
    if not callable(loss_fn):
        raise TypeError(
            f"setup() expects a callable loss_fn(outputs, targets), None (the model returns its own loss) or a "
            f"loom.LossCall, got {type(loss_fn).__name__}"
        )
    return LossCall(loss_fn)
