"""Copy a live member's training state to the members of a new epoch: tensors over the group, no pickle.

A replacement must train bitwise like the others at its first step: it receives the model's parameters and buffers
(broadcast in place: the same script built the same shapes), the optimizer's state and hyperparameters, the
committed step (also the data position) and the RNG state. The optimizer's state may not exist yet on a fresh
process (Adam makes it at its first step), so the source describes it in a small JSON header (the skeleton of
`loom.checkpoint.tree.flatten_state`, its tensors' keys, dtypes and shapes), checked before anything is allocated
from it (`check_header`); the tensors follow in its order. Nothing on the wire is executed.

Every member takes part in the broadcasts from `source_of`'s member; only those behind it (every member at the job's
first epoch) load what they received. If the source dies meanwhile, the broadcast fails on every member and the
epoch re-forms without it: another one sends.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.checkpoint.tree import flatten_state, unflatten_state
from loom.errors import HealStateRefused
from loom.fault.inject import fault_point

__all__ = [
    "HealStateRefused",
    "all_reduce_sum",
    "broadcast",
    "check_header",
    "share_training_state",
    "source_of",
]

MAX_HEADER_BYTES = 64 << 20
"""Bound on the JSON header a member receives (its size is the first thing broadcast): a few hundred bytes per
optimizer state entry; the bound keeps a wrong or lying size from allocating the machine's memory."""


_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.uint8, torch.bool)}  # fmt: skip


_sends = 0
"""Sends of this process's state to a replacement so far."""


def broadcast(tensor: torch.Tensor, source: int, group: dist.ProcessGroup) -> None:
    """Member ``source``'s ``tensor`` to every member, in place (on a group built outside torch's registry)."""
    options = dist.BroadcastOptions()
    options.rootRank = source
    group.broadcast([tensor], options).wait()


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The members' sum of ``tensor``, in place."""
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    group.allreduce([tensor], options).wait()


def source_of(steps: list[int]) -> int:
    """The member index that sends: the first holding the highest committed step."""
    return steps.index(max(steps))


def _header(optimizer: torch.optim.Optimizer, step: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    skeleton, flat = flatten_state(optimizer.state_dict())
    listed = [[key, str(t.dtype), list(t.shape)] for key, t in flat.items()]
    rng = torch.get_rng_state()
    header = {"step": step, "skeleton": skeleton, "tensors": listed, "rng_numel": rng.numel()}
    return header, [*flat.values(), rng]


def share_training_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, step: int, source: int, index: int,
    group: dist.ProcessGroup, load: bool, replacement: bool = False,
) -> int:  # fmt: skip
    """Broadcast member ``source``'s model, optimizer, RNG and step to the group; returns the source's step.
    ``load``: this member takes them (a replacement, or every member at the first epoch). ``replacement``: a
    member joins a running job (the sender counts these sends: the ``send`` fault point, `loom.fault.inject`)."""
    global _sends
    sending = index == source
    if sending and replacement:
        _sends += 1
        fault_point(_sends, "send")
    header, tensors = _header(optimizer, step) if sending else ({}, [])
    raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8) if sending else None
    size = torch.tensor([raw.numel() if raw is not None else 0], dtype=torch.int64)
    broadcast(size, source, group)
    if not 0 < int(size) <= MAX_HEADER_BYTES:
        raise HealStateRefused(f"the member sending the training state (index {source}) announced a header of "
                               f"{int(size)} bytes (at most {MAX_HEADER_BYTES}): nothing is loaded")  # fmt: skip
    buffer = raw if raw is not None else torch.empty(int(size), dtype=torch.uint8)
    broadcast(buffer, source, group)
    try:
        header = json.loads(bytes(buffer.tolist()).decode())
    except (ValueError, RecursionError) as error:  # RecursionError: nested past the interpreter's limit
        raise HealStateRefused(f"the member sending the training state (index {source}) sent a header that is "
                               f"not JSON ({error!s:.80}): nothing is loaded") from None  # fmt: skip
    if not sending:
        check_header(header, module, optimizer, source)
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            received = tensor.detach().clone() if not load else tensor.data
            broadcast(received, source, group)
    if not sending:
        tensors = [torch.empty(shape, dtype=_DTYPES[dtype]) for _, dtype, shape in header["tensors"]]
        tensors.append(torch.empty(header["rng_numel"], dtype=torch.uint8))
    for tensor in tensors:
        broadcast(tensor, source, group)
    if load and not sending:
        keys = [key for key, _, _ in header["tensors"]]
        optimizer.load_state_dict(unflatten_state(header["skeleton"], dict(zip(keys, tensors, strict=False))))
        torch.set_rng_state(tensors[-1])
    return int(header["step"])


def check_header(header: Any, module: nn.Module, optimizer: torch.optim.Optimizer, source: int) -> None:
    """Refuse (`HealStateRefused`, each check with its own message) a header that does not describe this process's
    optimizer, before anything is allocated from it: its tensors in all at most 16 times the model's parameters
    (Adam keeps 2) plus 1 MiB, its skeleton decoded over them on the meta device (no memory)."""

    def refuse(what: str) -> HealStateRefused:
        return HealStateRefused(f"the training state sent by member index {source} {what}: nothing is loaded. "
                                "HINT: every process must run the same script (the same model and optimizer)")  # fmt: skip

    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise refuse("has no list of tensors")
    step = header.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise refuse(f"claims the step {step!r}")
    budget = 16 * sum(p.numel() * p.element_size() for p in module.parameters()) + (1 << 20)
    total, meta = 0, {}
    for entry in header["tensors"]:
        key, dtype, shape = entry if isinstance(entry, list) and len(entry) == 3 else (None, None, None)
        dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else None
        dims = isinstance(shape, list) and all(type(n) is int and 0 <= n <= budget for n in shape)  # no bools
        shape = shape if dims else None
        if not isinstance(key, str) or key in meta or dtype is None or shape is None:
            raise refuse(
                f"has the tensor entry {str(entry)[:80]} (a key twice, or a shape or dtype not one a tensor has)"
            )
        total += math.prod(shape) * dtype.itemsize
        if total > budget:
            raise refuse(
                f"describes more than {budget} bytes of optimizer state (16x the model's parameters)"
            )
        meta[key] = torch.empty(shape, dtype=dtype, device="meta")
    try:
        state = unflatten_state(header.get("skeleton"), meta)
        indices, groups = list(state["state"].keys()), [g["params"] for g in state["param_groups"]]
        found = [v for s in state["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise refuse(f"has a skeleton that is not an optimizer's state ({error!s:.80})") from None
    if len({id(t) for t in found}) < len(found):
        raise refuse("names one tensor for two states")
    params = sum(len(g["params"]) for g in optimizer.param_groups)
    outside = [i for i in indices if not isinstance(i, int) or not 0 <= i < params]
    if outside:
        raise refuse(f"has the state of parameter {outside[0]!r} (parameter index outside 0..{params - 1})")
    if header.get("rng_numel") != torch.get_rng_state().numel():
        raise refuse(
            f"has an RNG state of {header.get('rng_numel')!r} bytes, not {torch.get_rng_state().numel()}"
        )
    mine = [g["params"] for g in optimizer.state_dict()["param_groups"]]
    if groups != mine:
        raise refuse(
            f"has {len(groups)} parameter groups holding {str(groups)[:80]}, not {len(mine)} holding {mine}"
        )
