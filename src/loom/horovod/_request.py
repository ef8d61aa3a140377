"""One submitted collective (`Request`) and the engine's error: what the negotiation (`loom.horovod._engine`) and
the data movement (`loom.horovod._ops`) share, in a leaf module so that neither imports the other back."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from loom.errors import HorovodInternalError

__all__ = ["HorovodInternalError", "Request"]


@dataclass
class Request:
    """One submitted collective: its inputs, where results go, and its completion."""

    kind: str
    tensors: list[torch.Tensor]
    args: dict[str, Any]
    outputs: list[torch.Tensor] | None = None
    name: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def meta(self) -> dict[str, Any]:
        """What every rank must agree on (or know about the others), as JSON-able values."""
        return {
            "kind": self.kind,
            "dtypes": [str(t.dtype) for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
            **self.args,
        }

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()
