"""Silent faults made loud: replicas that drift apart, and steps that turn the weights NaN.

Data parallelism keeps replicas identical only by construction; a bug (a rank skipping a step, a comm hook that
differs per rank, a stray in-place edit, a bit flip) breaks that silently. `check_replicas_agree` compares an exact
64-bit fingerprint of each parameter tensor (`_fingerprint`: one pass on its device, no copy to the host) across the
ranks; replicas of a correct job are bitwise equal, so there is no false alarm. Limits: two tensors share a
fingerprint with a 2**-64 chance; buffers (BatchNorm statistics) are not compared; it is meant for replicated
strategies, not sharded ones.

`NonFiniteGuard` is the policy for a step whose loss or gradient is NaN or infinite on some rank, the same verdict
on every rank from the flags the step reduces anyway (`loom.train.guard`).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.errors import NonFiniteStepError, ReplicaDesyncError, check_choice, check_int  # noqa: F401 - raised here, defined there
from loom.fault.watchdog import collective

__all__ = [
    "NONFINITE_POLICIES",
    "NonFiniteGuard",
    "NonFiniteStepError",
    "ReplicaDesyncError",
    "check_replicas_agree",
    "fingerprints",
    "gradients_finite",
]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: spreads position weights over 64 bits


def _fingerprint(tensor: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """sum_i bits_i * w_i (mod 2**64): any changed element or swapped pair changes it. In chunks, so the
    temporaries stay small (8 MB per chunk)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for start in range(0, bits.numel(), chunk):
        piece = bits[start : start + chunk].to(torch.int64)
        positions = torch.arange(start + 1, start + piece.numel() + 1, dtype=torch.int64, device=bits.device)
        total += (piece * (positions * _GOLDEN + 1)).sum()
    return total


def fingerprints(module: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names of ``module``'s parameters and a 64-bit fingerprint of each (an int64 tensor on their device)."""
    named = list(module.named_parameters())
    if not named:
        return [], torch.zeros(0, dtype=torch.int64)
    return [n for n, _ in named], torch.stack([_fingerprint(p) for _, p in named])


def check_replicas_agree(module: nn.Module, group: Any = None, *, step: int | None = None) -> None:
    """Raise `ReplicaDesyncError` on every rank of ``group`` unless all replicas of ``module`` are bitwise equal.

    A collective: every rank of ``group`` (default: the whole job) must call it at the same point; a no-op
    without a process group. Ranks are named globally where there is a default group, else by their rank in
    ``group``. The ranks that differ from the majority are named (on a tie, the side holding the lowest rank
    counts as the majority); ``step`` only goes into the message.
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return
    names, mine = fingerprints(module)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    with collective("desync check"):
        dist.all_gather(gathered, mine, group=group)
    rows = [tuple(t.tolist()) for t in gathered]
    if len(set(rows)) == 1:
        return
    counts = Counter(rows)
    majority = max(counts, key=lambda row: (counts[row], -rows.index(row)))
    named_globally = group is not None and dist.is_initialized()  # else the group's own ranks are the names
    ranks = [dist.get_global_rank(group, i) if named_globally else i for i in range(world)]
    differing = [ranks[i] for i, row in enumerate(rows) if row != majority]
    agreeing = [ranks[i] for i, row in enumerate(rows) if row == majority]
    first_bad = rows[ranks.index(differing[0])]
    tensors = [n for n, a, b in zip(names, majority, first_bad, strict=True) if a != b]
    shown = ", ".join(tensors[:5]) + (f" and {len(tensors) - 5} more" if len(tensors) > 5 else "")
    at = f" at step {step}" if step is not None else ""
    raise ReplicaDesyncError(
        f"replicas disagree{at}: ranks {differing} hold parameters different from ranks {agreeing} "
        f"(rank {differing[0]} differs in {shown}). HINT: every rank must apply the same update; look for "
        "rank-dependent code that touches the parameters, or a comm hook that returns different values per rank."
    )


# -- non-finite steps -------------------------------------------------------------------------------------------
NONFINITE_POLICIES = ("skip", "stop")
"""What a strategy does with a step whose loss or gradient is NaN or infinite on some rank."""

LOSS_FLAG, GRADIENT_FLAG = 1, 2
"""Bits of a rank's flag in the reduced buffer: its local loss, its local (not yet averaged) gradient."""


def gradients_finite(grads: Sequence[torch.Tensor | None], flat: torch.Tensor | None = None) -> bool:
    """Whether every gradient is finite: one sum per tensor, not a check per element.

    A plain sum propagates every NaN and infinity (``inf - inf`` is NaN); it is taken in float32 at least, so
    that a half-precision gradient whose finite values merely add up past 65504 is not flagged. ``flat``, when
    the gradients already lie in one buffer, is summed in one call instead. On the CPU each sum is read at once
    (a tensor op costs more than the read); elsewhere the sums are stacked and read once (one device sync).
    """
    parts = [flat] if flat is not None else [g for g in grads if g is not None]
    if not parts:
        return True
    sums = [_sum(g) for g in parts]
    if all(s.device.type == "cpu" for s in sums):
        return math.isfinite(sum(s.item() for s in sums))
    return bool(torch.isfinite(torch.stack([s.to(torch.float64) for s in sums]).sum()))


def _sum(g: torch.Tensor) -> torch.Tensor:
    if g.is_sparse:
        g = g.coalesce().values()
    if g.is_complex():
        g = torch.view_as_real(g)
    return g.sum(dtype=torch.float32) if g.element_size() < 4 else g.sum()


def local_flag(loss: float | torch.Tensor, grads: Sequence[torch.Tensor | None] = ()) -> float:
    """This rank's flag (`LOSS_FLAG` | `GRADIENT_FLAG` bits) for its local loss and local gradients."""
    flag = 0 if math.isfinite(float(loss)) else LOSS_FLAG
    if grads and not gradients_finite(grads):
        flag |= GRADIENT_FLAG
    return float(flag)


@dataclass
class NonFiniteGuard:
    """The policy for non-finite steps of one job: decides, counts, and names the ranks."""

    policy: str = "skip"
    """``"skip"``: no update on any rank, counted; ``"stop"``: raise `NonFiniteStepError` at once."""
    limit: int = 5
    """Non-finite steps in a row after which ``"skip"`` stops the job too (the data or the model is broken)."""
    rank: int = 0
    skipped: int = 0
    """Steps skipped so far by this job (in this process's lifetime)."""
    in_a_row: int = 0
    history: list[int] = field(default_factory=list)
    """The step numbers of the skipped steps."""

    def __post_init__(self) -> None:
        hint = "'skip' drops a non-finite step on every rank, 'stop' raises."
        check_choice("nonfinite", self.policy, NONFINITE_POLICIES, hint)
        check_int("nonfinite_limit", self.limit)

    def judge(
        self, step: int, flags: Sequence[float], ranks: Sequence[int], averaged_gradient_finite: bool = True
    ) -> bool:
        """True when step ``step`` must not be applied (on every rank alike: the inputs are the same on every
        rank). ``flags[i]`` is rank ``ranks[i]``'s flag from the reduced buffer; ``averaged_gradient_finite``
        the check of a gradient already averaged (so the same everywhere). Raises `NonFiniteStepError` under
        ``"stop"``, or when ``limit`` steps in a row were non-finite."""
        bad = {r: int(f) for r, f in zip(ranks, flags, strict=True) if f}
        if not bad and averaged_gradient_finite:
            self.in_a_row = 0
            return False
        what = describe_nonfinite(bad, averaged_gradient_finite)
        self.skipped += 1
        self.in_a_row += 1
        self.history.append(step)
        if self.policy == "stop":
            raise NonFiniteStepError(
                f"step {step} is non-finite: {what} (seen on rank {self.rank}); nonfinite='stop' stops the job "
                "before the update is applied. HINT: look for NaN/Inf in that rank's inputs or targets, lower "
                "the learning rate, or pass nonfinite='skip' to drop such steps."
            )
        if self.in_a_row >= self.limit:
            raise NonFiniteStepError(
                f"{self.in_a_row} steps in a row (steps {step - self.in_a_row + 1} to {step}) were non-finite, "
                f"the last: {what} (seen on rank {self.rank}); none was applied. HINT: the data or the model "
                "is broken from here on: look for NaN/Inf in those ranks' inputs, or lower the learning rate; "
                "nonfinite_limit sets how many non-finite steps in a row are tolerated."
            )
        if self.rank == 0:
            print(
                f"loom: step {step} skipped on every rank: {what} ({self.in_a_row} in a row, "
                f"{self.skipped} in all; the job stops after {self.limit} in a row)",
                file=sys.stderr,
                flush=True,
            )
        return True


def describe_nonfinite(bad: dict[int, int], averaged_gradient_finite: bool = True) -> str:
    """``"loss on rank(s) [1]; gradient on rank(s) [0, 1]"``, from the flags of the ranks that set one."""
    parts = []
    for bit, what in ((LOSS_FLAG, "loss"), (GRADIENT_FLAG, "gradient")):
        ranks = [r for r, f in bad.items() if f & bit]
        if ranks:
            parts.append(f"non-finite {what} on rank(s) {ranks}")
    if not averaged_gradient_finite:
        parts.append("non-finite averaged gradient (on every rank)")
    return "; ".join(parts)
