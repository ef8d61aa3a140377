"""Copy a live member's training state to the members of a new epoch: tensors over the group, no pickle.

A replacement must train bitwise like the others at its first step, so it receives the model's parameters and
buffers (broadcast in place: the same script built the same shapes), the optimizer's state and hyperparameters,
the committed step (also the data position) and the RNG state. The optimizer's state may not exist yet on a fresh
process (Adam makes it at its first step), so the source describes it in a small JSON header, checked before
anything is allocated from it (`check_header`), and the tensors follow in its order. JSON, not pickle: nothing on
the wire is executed.

The source is the first member holding the highest committed step (`source_of`); every member takes part in the
broadcasts, and only those behind it (every member at the job's first epoch) load what they received. If the
source dies meanwhile, the broadcast fails on every member and the epoch re-forms without it: another one sends.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
    state = optimizer.state_dict()
    entries, tensors = [], []
    for param, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                entries.append([int(param), key, list(value.shape), str(value.dtype), None])
                tensors.append(value.detach().contiguous())
            else:
                entries.append([int(param), key, None, None, value])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    rng = torch.get_rng_state()
    tensors.append(rng)
    return {"step": step, "entries": entries, "groups": groups, "rng_numel": rng.numel()}, tensors


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
    header = json.loads(bytes(buffer.tolist()).decode())
    if not sending:
        check_header(header, module, optimizer, source)
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            received = tensor.detach().clone() if not load else tensor.data
            broadcast(received, source, group)
    if not sending:
        tensors = [torch.empty(shape, dtype=_DTYPES[dtype]) for _, _, shape, dtype, _ in header["entries"]
                   if shape is not None]  # fmt: skip
        tensors.append(torch.empty(header["rng_numel"], dtype=torch.uint8))
    for tensor in tensors:
        broadcast(tensor, source, group)
    if load and not sending:
        _load_optimizer(optimizer, header, tensors[:-1])
        torch.set_rng_state(tensors[-1])
    return int(header["step"])


def check_header(header: Any, module: nn.Module, optimizer: torch.optim.Optimizer, source: int) -> None:
    """Refuse (`HealStateRefused`) a header that does not describe this process's optimizer before anything is
    allocated from it: the step a non-negative int, each entry's parameter one of the optimizer's, its dtype a
    known one, its shape non-negative ints, the tensors in all at most 16 times the model's parameters (Adam
    keeps 2) plus 1 MiB, the RNG state the size of this process's, the groups as many as the optimizer's."""

    def refuse(what: str) -> HealStateRefused:
        return HealStateRefused(f"the training state sent by member index {source} {what}: nothing is loaded. "
                                "HINT: every process must run the same script (the same model and optimizer)")  # fmt: skip

    if not isinstance(header, dict) or not isinstance(header.get("entries"), list):
        raise refuse("has no list of entries")
    step = header.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise refuse(f"claims the step {step!r}")
    params = sum(len(g["params"]) for g in optimizer.param_groups)
    budget = 16 * sum(p.numel() * p.element_size() for p in module.parameters()) + (1 << 20)
    total = 0
    for entry in header["entries"]:
        param = entry[0] if isinstance(entry, list) and len(entry) == 5 else None
        if not isinstance(param, int) or not 0 <= param < params:
            raise refuse(f"has the entry {str(entry)[:80]} (parameter index outside 0..{params - 1})")
        shape, dtype = entry[2], entry[3]
        if shape is None:
            continue
        dims = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)  # (bools refused)
        if dtype not in _DTYPES or not dims:
            raise refuse(f"has the tensor entry {str(entry)[:80]} (shape or dtype not one a tensor has)")
        total += math.prod(shape) * _DTYPES[dtype].itemsize
        if total > budget:
            raise refuse(
                f"describes more than {budget} bytes of optimizer state (16x the model's parameters)"
            )
    if header.get("rng_numel") != torch.get_rng_state().numel():
        raise refuse(
            f"has an RNG state of {header.get('rng_numel')!r} bytes, not {torch.get_rng_state().numel()}"
        )
    if not isinstance(header.get("groups"), list) or len(header["groups"]) != len(optimizer.param_groups):
        raise refuse(
            f"has {len(header.get('groups') or [])} parameter groups, not {len(optimizer.param_groups)}"
        )


def _load_optimizer(
    optimizer: torch.optim.Optimizer, header: dict[str, Any], tensors: list[torch.Tensor]
) -> None:
    mine = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    received = iter(tensors)
    for param, key, shape, _dtype, value in header["entries"]:
        state.setdefault(param, {})[key] = next(received) if shape is not None else value
    groups = [
        local | {k: tuple(v) if isinstance(local.get(k), tuple) else v for k, v in sent.items()}
        for local, sent in zip(mine["param_groups"], header["groups"], strict=True)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
