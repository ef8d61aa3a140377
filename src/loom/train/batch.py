"""What every strategy does to a batch before its own work: take it apart, size it, slice it, move it, and
turn it into a loss (`LossCall`, `forward_loss`: the one calling convention of every strategy).

A batch is ``(inputs, targets)`` as `loom.data.loader` yields it, or another shape `LossCall` accepts; ``inputs``
may be a tensor or any nesting of lists, tuples and dicts of tensors whose first dimension is the sample. Its size
is that first dimension of the first tensor found, so every tensor in a batch must share it (not checked here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

__all__ = [
    "LossCall",
    "batch_len",
    "forward_loss",
    "micro_batches",
    "model_loss",
    "slice_batch",
    "split_batch",
    "tensors_in",
    "to_device",
]


@dataclass(frozen=True)
class LossCall:
    """How a strategy calls the model and the loss on a batch: ``setup(model, optimizer, loss_fn)`` takes a
    plain callable (the first row), None (the last) or a `LossCall` (any row).

    ==============================================  =================================  ===========================
    ``loss_fn``                                     the model is called as             the loss is
    ==============================================  =================================  ===========================
    ``fn`` (plain, every strategy)                  ``model(inputs)``                  ``fn(outputs, targets)``
    ``LossCall(fn, unpack_inputs=True)``            ``model(*inputs)``,                ``fn(outputs, targets)``
                                                    ``model(**inputs)`` for a dict
    ``LossCall(fn, whole_batch=True)``              ``model(inputs)``                  ``fn(outputs, batch)``
    ``None`` = ``LossCall(None)``: the model        ``model(*batch)``,                 the model's own (`model_loss`)
    returns its own loss (nanoGPT, Hugging Face)    ``model(**batch)`` for a dict
    ==============================================  =================================  ===========================

    ``inputs, targets = batch[0], batch[1]``; where no targets are needed (``whole_batch``, the model's own loss)
    the batch may also be a dict or a tensor, and is then the inputs itself. Every loss must be the *mean* over
    the batch's samples (PyTorch's default reduction): strategies weight it by the share's sample count.
    """

    fn: Callable[..., torch.Tensor] | None = None
    """The loss function; None: the model's output carries the loss."""
    unpack_inputs: bool = False
    """Spread ``inputs`` over the model's arguments: ``model(*inputs)`` (``model(**inputs)`` for a dict)."""
    whole_batch: bool = False
    """Pass the whole batch to ``fn`` in place of the targets: ``fn(outputs, batch)``."""

    def __post_init__(self) -> None:
        if self.fn is not None and not callable(self.fn):
            raise TypeError(f"LossCall(fn=...) must be callable or None, got {type(self.fn).__name__}")
        if self.fn is None and (self.unpack_inputs or self.whole_batch):
            raise ValueError(
                "LossCall(None, ...): a model that returns its own loss is called with every item of the batch "
                "(model(*batch)); unpack_inputs and whole_batch apply to a loss function. HINT: LossCall(None)."
            )

    @classmethod
    def of(cls, loss_fn: Any) -> LossCall:
        """``loss_fn`` as a `LossCall`: a `LossCall` itself, None (the model's own loss) or a plain callable; a
        clear error for anything else."""
        if isinstance(loss_fn, LossCall):
            return loss_fn
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"setup() expects a callable loss_fn(outputs, targets), None (the model returns its own loss) or a "
                f"loom.LossCall, got {type(loss_fn).__name__}"
            )
        return cls(loss_fn)

    @property
    def plain(self) -> bool:
        """``fn(model(inputs), targets)``: the convention every strategy supports."""
        return self.fn is not None and not self.unpack_inputs and not self.whole_batch

    def describe(self) -> str:
        if self.fn is None:
            return "the model's own loss (loss_fn=None: model(*batch))"
        parts = [p for p, on in (("unpack_inputs=True", self.unpack_inputs), ("whole_batch=True",
                 self.whole_batch)) if on]  # fmt: skip
        return f"LossCall({', '.join(['fn', *parts])})" if parts else "loss_fn(model(inputs), targets)"

    def needs_pair(self) -> bool:
        """Whether batches must be ``(inputs, targets)`` pairs (the targets go to the loss function)."""
        return self.fn is not None and not self.whole_batch

    def inputs_of(self, batch: Any) -> Any:
        """What the model is given (before unpacking): ``batch[0]``, or a dict or tensor batch itself."""
        if self.needs_pair():
            return split_batch(batch)[0]
        if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and self.fn is not None:
            return batch[0]
        return batch

    def second_argument(self, batch: Any) -> Any:
        """What the loss function (and an evaluation metric) takes after the outputs: targets, or the batch."""
        return split_batch(batch)[1] if self.needs_pair() else batch


def _call(model: Callable[..., Any], args: Any) -> Any:
    if isinstance(args, Mapping):
        return model(**args)
    if isinstance(args, (list, tuple)):
        return model(*args)
    return model(args)


def forward_loss(call: LossCall, model: Callable[..., Any], batch: Any) -> tuple[torch.Tensor, Any]:
    """``(loss, outputs)`` of ``model`` on ``batch`` under ``call``'s convention (see `LossCall`)."""
    if call.fn is None:
        outputs = _call(model, batch)
        return model_loss(outputs), outputs
    inputs = call.inputs_of(batch)
    outputs = _call(model, inputs) if call.unpack_inputs else model(inputs)
    return call.fn(outputs, call.second_argument(batch)), outputs


def model_loss(outputs: Any) -> torch.Tensor:
    """The loss a model returned: the output itself when it is a scalar tensor, its ``loss`` attribute or key
    (Hugging Face), or the one scalar tensor of a tuple (nanoGPT's ``logits, loss``)."""
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return outputs
    found = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(outputs, (list, tuple)):
        scalars = [t for t in outputs if isinstance(t, torch.Tensor) and t.dim() == 0]
        if len(scalars) == 1:
            return scalars[0]
    shape = (
        f"a tensor of shape {tuple(outputs.shape)}"
        if isinstance(outputs, torch.Tensor)
        else type(outputs).__name__
    )
    raise TypeError(
        f"loss_fn=None means the model returns its own loss, but it returned {shape}: expected a scalar tensor, "
        "an output with a .loss, or a tuple holding exactly one scalar tensor (e.g. (logits, loss)). HINT: pass "
        "a loss_fn(outputs, targets), or loom.LossCall(fn, whole_batch=True) for fn(outputs, batch)."
    )


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` of ``batch``; a clear error for anything that is not such a pair."""
    if not isinstance(batch, Sequence) or isinstance(batch, (str, bytes)) or len(batch) < 2:
        got = type(batch).__name__ + (f" with keys {list(batch)[:8]}" if isinstance(batch, Mapping) else "")
        raise TypeError(
            f"a batch must be a pair (inputs, targets), got {got}. loom.data.loader collates samples as "
            "DataLoader does: a dataset returning a dict gives a dict, one tensor per sample gives a tensor. "
            "HINT: return (inputs, target) from the dataset's __getitem__, or pass a collate_fn=... that builds "
            "(inputs, targets) to job.loader / loom.data.loader."
        )
    return batch[0], batch[1]


def batch_len(inputs: Any) -> int:
    """Samples in ``inputs``: the first dimension of its first tensor (1 for a scalar)."""
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0]) if inputs.dim() else 1
    if isinstance(inputs, (list, tuple)) and inputs:
        return batch_len(inputs[0])
    if isinstance(inputs, dict) and inputs:
        return batch_len(next(iter(inputs.values())))
    raise TypeError(f"cannot tell the batch size of inputs of type {type(inputs).__name__}")


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor, keeping its nesting; other leaves are kept whole."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        # a namedtuple keeps its type, any other tuple becomes a plain one (a loader's `ShardBatch` describes
        # the whole share, so a slice or a copy of it is a plain tuple)
        items = [_map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def slice_batch(value: Any, lo: int, hi: int) -> Any:
    """Samples ``lo:hi`` of every tensor in ``value``, keeping its nesting; other leaves are kept whole."""
    return _map_tensors(value, lambda t: t[lo:hi])


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor moved to ``device`` (non-blocking), keeping its nesting."""
    return _map_tensors(value, lambda t: t.to(device, non_blocking=True))


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or any nesting of lists, tuples and dicts), in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple, dict)):
        for v in value.values() if isinstance(value, dict) else value:
            yield from tensors_in(v)


def micro_batches(batch: Any, n: int, pieces: int) -> list[tuple[Any, int]]:
    """``pieces`` slices of the whole ``batch`` of ``n`` samples, with their sizes."""
    if pieces == 1:
        return [(batch, n)]
    bounds = torch.arange(pieces + 1) * n // pieces
    return [(slice_batch(batch, lo, hi), hi - lo) for lo, hi in pairwise(bounds.tolist())]
