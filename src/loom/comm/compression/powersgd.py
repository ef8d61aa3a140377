"""``powersgd:<rank>``: send a rank-r approximation of each gradient matrix (Vogels, Karimireddy & Jaggi 2019).

"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019, Algorithm 1
with error feedback. Each gradient of a bucket, plus the residual from the previous step, is viewed as a matrix
``M`` (n x m: output dimension by everything else, so a conv weight ``(out, in, kh, kw)`` is ``out x in*kh*kw``).
With a ``Q`` (m x r) identical on every rank:

1. ``P = M Q``, all-reduced (summed): by linearity, ``sum_i M_i Q = (sum_i M_i) Q``;
2. ``P`` is orthonormalized (reduced QR), the same on every rank since the sum is;
3. ``Q = M^T P``, all-reduced and divided by N: the mean gradient projected on P's columns;
4. the mean gradient is approximated by ``P Q^T`` (one power-iteration step); each rank keeps ``M_i - P Q_i^T``
   (``Q_i`` its step-3 term before the all-reduce) as its residual, so what the approximation missed is sent later.

*Warm start*: step 3's ``Q`` seeds the next step's step 1, so one power iteration per step suffices. The first
``Q`` is drawn from a generator seeded by (seed, parameter number), identical on every rank without a
broadcast; a zero or non-finite ``Q`` is redrawn (zero gradients would keep it zero forever).

Bytes: ``(n + m) r`` numbers per matrix instead of ``n m``, in two all-reduces whose size, unlike top-k's
all-gather, does not grow with the ranks. Tensors that do not gain (1-D ones, and matrices where ``(n + m) r
>= n m``) are all-reduced exactly, packed into the P all-reduce.

Limits: biased, relying on error feedback to converge; the residual costs one gradient of memory, plus ``m r``
numbers per matrix for Q; round 2 waits for round 1 (`loom.comm.compression.hook` overlaps them with later
buckets). 16-bit tensors are compressed in float32 (QR needs it) and cast back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loom.comm.compression.base import Collective, Exchange, check_codec_state, check_layout
from loom.comm.compression.feedback import ErrorFeedback
from loom.errors import check_int

__all__ = ["PowerSGDCodec"]


@dataclass(frozen=True)
class _Segment:
    """One tensor of a bucket: where it sits in the flat gradient and, if compressed, its matrix shape."""

    offset: int
    numel: int
    rows: int = 0
    cols: int = 0
    rank: int = 0  # 0: sent exactly

    @property
    def compressed(self) -> bool:
        return self.rank > 0


class PowerSGDCodec:
    """Rank-``rank`` PowerSGD with error feedback and warm start; see the module docstring."""

    def __init__(self, rank: int, seed: int = 0) -> None:
        check_int("PowerSGD rank", rank)
        self.rank = rank
        self.seed = int(seed)
        self.spec = f"powersgd:{rank}"
        self._feedback = ErrorFeedback()
        self._qs: dict[int, torch.Tensor] = {}
        """Warm start per compressed parameter: its last averaged Q (cols x rank)."""

    def plan(self, shapes: Sequence[torch.Size]) -> list[_Segment]:
        """Which tensors are compressed, and as which matrices (public for tests and byte estimates)."""
        segments, offset = [], 0
        for shape in shapes:
            numel = int(torch.Size(shape).numel())
            rows = int(shape[0]) if len(shape) >= 2 else 0
            cols = numel // rows if rows else 0
            r = min(self.rank, rows, cols)
            compressed = rows and (rows + cols) * r < rows * cols
            segments.append(_Segment(offset, numel, rows, cols, r) if compressed else _Segment(offset, numel))
            offset += numel
        return segments

    def compressed_numel(self, shapes: Sequence[torch.Size]) -> int:
        """Numbers sent per rank and step for a bucket of ``shapes`` (both all-reduces together)."""
        return sum((s.rows + s.cols) * s.rank if s.compressed else s.numel for s in self.plan(shapes))

    def exchange(
        self, params: Sequence[int], flat: torch.Tensor, shapes: Sequence[torch.Size], world_size: int
    ) -> Exchange:
        check_layout(flat, shapes, params)
        self._feedback.bind(params, shapes)
        segments = self.plan(shapes)
        work_dtype = flat.dtype if flat.element_size() >= 4 else torch.float32
        accumulated = flat.to(work_dtype, copy=True)
        self._feedback.add_to(accumulated, params, shapes)
        plain = [s for s in segments if not s.compressed]
        packed = [(p, s) for p, s in zip(params, segments, strict=True) if s.compressed]
        matrices = [accumulated[s.offset : s.offset + s.numel].view(s.rows, s.cols) for _, s in packed]
        qs = [self._warm_start(p, s).to(work_dtype) for p, s in packed]

        ps = [m @ q for m, q in zip(matrices, qs, strict=True)]
        first = [accumulated[s.offset : s.offset + s.numel] for s in plain] + [p.reshape(-1) for p in ps]
        summed = yield Collective("sum", torch.cat(first), final=not packed)

        out = torch.empty_like(accumulated)
        pieces = summed.split([s.numel for s in plain] + [s.rows * s.rank for _, s in packed])
        for s, piece in zip(plain, pieces[: len(plain)], strict=True):
            out[s.offset : s.offset + s.numel] = piece / world_size
        if not packed:
            return out.to(flat.dtype)
        orthonormal = [
            _orthonormalize(p.view(s.rows, s.rank))
            for (_, s), p in zip(packed, pieces[len(plain) :], strict=True)
        ]

        new_qs = [m.T @ p for m, p in zip(matrices, orthonormal, strict=True)]
        # Error feedback with this rank's own approximation P Q_i^T (Algorithm 2 of the paper), i.e. what the
        # shared subspace misses of *this* rank's matrix. Subtracting the averaged P Q^T instead (as PyTorch's
        # powerSGD_hook does) would also keep each rank's deviation from the mean: it cancels in the average but
        # adds up, step after step, in every residual.
        # The residual is made in ``accumulated`` itself, each matrix's last use (no second gradient-sized buffer
        # and no copy into it); the tensors sent exactly leave none.
        for m, p, q in zip(matrices, orthonormal, new_qs, strict=True):
            m.sub_(p @ q.T)
        for s in plain:
            accumulated[s.offset : s.offset + s.numel] = 0
        residual = accumulated
        summed = yield Collective("sum", torch.cat([q.reshape(-1) for q in new_qs]), final=True)

        pieces = summed.split([s.cols * s.rank for _, s in packed])
        for (param, s), p, piece in zip(packed, orthonormal, pieces, strict=True):
            q = piece.view(s.cols, s.rank) / world_size
            torch.mm(p, q.T, out=out[s.offset : s.offset + s.numel].view(s.rows, s.cols))
            if bool(torch.isfinite(q).all()) and q.abs().sum() > 0:
                self._qs[param] = q.clone()
            else:
                self._qs.pop(param, None)  # redrawn next step
        self._feedback.keep(residual, params, shapes)
        return out.to(flat.dtype)

    def _warm_start(self, param: int, segment: _Segment) -> torch.Tensor:
        """Parameter ``param``'s last Q, or the same random m x r matrix on every rank, seeded by (seed, param)."""
        q = self._qs.get(param)
        if q is not None and q.shape == (segment.cols, segment.rank):
            return q
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + param) % (2**63 - 1))
        q = torch.randn(segment.cols, segment.rank, generator=generator)
        return q / math.sqrt(segment.cols)

    def state_dict(self) -> dict[str, Any]:
        """Per bucket last exchanged (`ErrorFeedback.state_dict`), plus ``"q"``: ``{param: Q}`` of its matrices."""
        buckets = self._feedback.state_dict()
        for bucket in buckets.values():
            qs = {str(p): self._qs[p].clone() for p in bucket["params"] if p in self._qs}
            if qs:
                bucket["q"] = qs
        return {"codec": self.spec, "seed": self.seed, "buckets": buckets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_codec_state(state, self.spec)
        self.seed = int(state.get("seed", self.seed))
        buckets = state["buckets"]
        self._feedback.load_state_dict(buckets)
        self._qs = {int(p): q.clone() for b in buckets.values() for p, q in b.get("q", {}).items()}

    def __repr__(self) -> str:
        return f"PowerSGDCodec(rank={self.rank})"


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s: reduced QR with R's diagonal made non-negative.

    Householder QR leaves each column's sign to rounding (it flips when a pivot is near zero), which would
    make the warm-started Q flip with it; with R's diagonal >= 0 the factor is unique and continuous for
    full-rank ``p``, like Gram-Schmidt (which Vogels et al. use) but stable.
    """
    q, r = torch.linalg.qr(p, mode="reduced")
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(q.dtype)
    return q * signs
