"""Random number generator state as checkpoint data: torch (CPU and CUDA), Python's `random`, numpy's global RNG.

A resumed run reproduces an uninterrupted one only if every generator the step consumes (dropout, data
augmentation, `random.shuffle` in user code) continues from where it stopped. `capture_rng` returns a tree
`save_checkpoint` can store (tensors and JSON values, no pickle); `restore_rng` puts it back.

Limits: only the *global* generators are covered. ``torch.Generator`` objects a user creates, and numpy's
``default_rng()`` generators, belong in that user's own state. CUDA states are restored only when the number
of visible devices matches the saved one.
"""

from __future__ import annotations

import base64
import random
import warnings
from typing import Any

import numpy
import torch

__all__ = ["capture_rng", "restore_rng"]


def _words(values: Any) -> str:
    """32-bit words as one base64 string (little-endian): one JSON value instead of 624, which keeps a
    checkpoint's ``state.json`` within its read bounds for thousands of ranks (`loom.checkpoint.limits`)."""
    return base64.b64encode(numpy.asarray(values, dtype="<u4").tobytes()).decode()


def _unwords(value: Any) -> list[int]:
    """The words `_words` packed; a list (what loom wrote before) as it is."""
    if not isinstance(value, str):
        return [int(v) for v in value]
    return numpy.frombuffer(base64.b64decode(value, validate=True), dtype="<u4").tolist()


def capture_rng() -> dict[str, Any]:
    """The state of the global generators, as ``{"torch", "python", "numpy", "cuda"}``."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),  # a uint8 tensor
        "python": {"version": version, "internal": _words(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": str(name),
            "keys": _words(keys),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "cuda": [t.clone() for t in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None,
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Set the global generators to a state `capture_rng` returned (parts that are missing are left alone)."""
    if not isinstance(state, dict):
        raise TypeError(f"restore_rng expects the dict capture_rng() returned, got {type(state).__name__}")
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    python = state.get("python")
    if python is not None:
        random.setstate((python["version"], tuple(_unwords(python["internal"])), python["gauss_next"]))
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        keys = numpy.asarray(_unwords(numpy_state["keys"]), dtype=numpy.uint32)
        rest = (numpy_state[k] for k in ("pos", "has_gauss", "cached_gaussian"))
        numpy.random.set_state((numpy_state["bit_generator"], keys, *rest))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([t.to(torch.uint8).cpu() for t in cuda])
        else:
            warnings.warn(
                f"the checkpoint holds CUDA RNG states for {len(cuda)} devices but this process sees "
                f"{torch.cuda.device_count()}; CUDA generators were not restored",
                stacklevel=2,
            )
