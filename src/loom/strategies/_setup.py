"""The check every strategy's ``setup(model, optimizer, loss_fn)`` makes before it touches the model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["check_setup_arguments"]


def check_setup_arguments(model: Any, optimizer: Any, loss_fn: Any) -> None:
    """Refuse arguments of the wrong type, and an optimizer holding parameters that are not the model's
    (it would step tensors the strategy never synchronizes)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"setup() expects an nn.Module as model, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"setup() expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"setup() expects a callable loss_fn(outputs, targets), got {type(loss_fn).__name__}")
    owned = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in the model. "
                    "HINT: build the optimizer from model.parameters() of the model passed to setup()."
                )
