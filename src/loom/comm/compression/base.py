"""What every codec shares: the `Codec` protocol, the `Collective` steps it yields, and the checks of its input.

A codec does not call `torch.distributed` itself. Its `Codec.exchange` is a generator that *yields* the
collectives it needs (`Collective`: sum these numbers over the ranks, or gather this message from every rank),
receives each result back, and finally *returns* the averaged gradient. Who runs the collectives is someone
else's business: `loom.comm.compression.hook` runs them asynchronously inside DDP's backward, and
`loom.comm.compression.local.exchange_locally` runs N codecs in one process, which is how the numerics are tested
without sockets. The schedule is data; the runtime is separate.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

__all__ = ["Codec", "Collective", "Exchange", "check_codec_state", "check_layout"]


@dataclass(frozen=True)
class Collective:
    """One collective a codec asks for, the same on every rank (same op, shape, dtype, order).

    ``op="sum"``: the runtime sums ``tensor`` over the ranks in place and sends ``tensor`` back.
    ``op="gather"``: ``tensor`` (1-D) is this rank's message; the runtime sends back a new tensor of shape
    ``(world_size, numel)`` whose row ``r`` is rank r's message.
    """

    op: Literal["sum", "gather"]
    tensor: torch.Tensor
    final: bool
    """True when no collective follows: what remains is local decoding, which the runtime may run when the
    message arrives, off the backward pass. A runtime must issue every non-final collective from the training
    thread, in order, so that all ranks agree on the sequence of collectives."""

    def __post_init__(self) -> None:
        if self.op not in ("sum", "gather"):
            raise ValueError(f"Collective op must be 'sum' or 'gather', got {self.op!r}")
        if self.op == "gather" and self.tensor.dim() != 1:
            raise ValueError(f"a gather message must be 1-D, got shape {tuple(self.tensor.shape)}")


Exchange = Generator[Collective, torch.Tensor, torch.Tensor]
"""The generator `Codec.exchange` returns: yields `Collective`s, receives their results, returns the average."""


@runtime_checkable
class Codec(Protocol):
    """A gradient compression scheme with its own state (error-feedback residuals, warm starts).

    Codecs are built by `loom.comm.compression.make_codec` from a spec string and are independent of one
    another (no base class to inherit). State is kept per *parameter* (`loom.comm.compression.feedback`), named
    by the integers the caller passes, so one codec object serves one DDP model: give each model its own codec.
    """

    spec: str
    """The string `make_codec` parses back into an equal codec, e.g. ``"topk:0.01"``."""

    def exchange(
        self, params: Sequence[int], flat: torch.Tensor, shapes: Sequence[torch.Size], world_size: int
    ) -> Exchange:
        """Average the 1-D gradient ``flat`` over ``world_size`` ranks, compressed.

        ``flat`` is the concatenation, without gaps, of tensors of the given ``shapes`` (a DDP bucket); the
        codec may overwrite it. ``params`` names each tensor by a number that stays the same at every step and
        in every bucketing (the key of its state). The generator's return value has ``flat``'s shape and dtype
        (it may be ``flat``).
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """Tensors, ints and strings only (no pickle): safe for a safetensors + JSON checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_layout(flat: torch.Tensor, shapes: Sequence[torch.Size], params: Sequence[int]) -> None:
    """Refuse ``shapes`` that do not tile the 1-D ``flat`` exactly, or ``params`` that do not name them once."""
    total = sum(int(torch.Size(s).numel()) for s in shapes)
    if flat.dim() != 1 or total != flat.numel():
        raise ValueError(
            f"tensor shapes {[tuple(s) for s in shapes]} hold {total} elements but the gradient has shape "
            f"{tuple(flat.shape)}. HINT: pass a 1-D gradient and the shapes of its tensors, in order."
        )
    if len(params) != len(shapes) or len(set(params)) != len(params):
        raise ValueError(
            f"parameter numbers {list(params)} must name the {len(shapes)} tensors of the gradient, each once. "
            "HINT: pass one distinct integer per tensor, the same for a tensor at every step."
        )


def check_codec_state(state: Any, spec: str) -> None:
    """Refuse a state saved by another codec (``"topk:0.1"`` residuals are no use to ``"topk:0.01"``...)."""
    saved = state.get("codec") if isinstance(state, dict) else None
    if saved != spec:
        raise ValueError(
            f"cannot load the state of codec {saved!r} into codec {spec!r}. "
            "HINT: build the codec with make_codec(state['codec']) before loading its state."
        )
