"""``powersgd:<rank>``: send a rank-r approximation of each gradient matrix (Vogels, Karimireddy & Jaggi 2019).

"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019, Algorithm 1
with error feedback. Each gradient tensor of a bucket is viewed as a matrix ``M`` (n x m: output dimension by
everything else, so a conv weight ``(out, in, kh, kw)`` is ``out x in*kh*kw``), after adding the residual kept
from the previous step. With a matrix ``Q`` (m x r) that every rank holds identically:

1. ``P = M Q``, all-reduced (summed) over the ranks: by linearity, ``sum_i M_i Q = (sum_i M_i) Q``;
2. ``P`` is orthonormalized (reduced QR), the same on every rank since the sum is;
3. ``Q = M^T P``, all-reduced and divided by N: the mean gradient projected on the columns of P;
4. the mean gradient is approximated by ``P Q^T`` (one step of subspace/power iteration); each rank keeps
   ``M_i - P Q_i^T``, what its own matrix loses in the shared subspace (``Q_i`` its step-3 term before the
   all-reduce), as its residual (error feedback), so what the approximation missed is sent later.

*Warm start*: step 3's ``Q`` seeds step 1 of the next step, so the power iteration continues across steps and
a single iteration per step suffices. The first ``Q`` is drawn from a generator seeded by (seed, bucket,
tensor), identical on every rank without a broadcast. A ``Q`` that became zero or non-finite is redrawn (zero
gradients would otherwise keep it zero forever).

Bytes: ``(n + m) r`` numbers per matrix instead of ``n m``, in two all-reduces (P, then Q). Tensors that do not
gain from it -- 1-D tensors (biases, norms) and matrices where ``(n + m) r >= n m`` -- are all-reduced exactly,
packed into the first all-reduce with the P's. Both all-reduces have a fixed size, unlike top-k's all-gather,
so PowerSGD's saving does not shrink as ranks are added.

Limits: the approximation is biased and relies on error feedback to converge; the residual costs one
gradient's worth of memory and the Q's ``m r`` numbers per matrix. The two rounds are sequential: the second
can only start once the first is reduced (`loom.comm.compression.hook` overlaps them with later buckets).
Tensors of 16-bit dtypes are compressed in float32 (QR needs it) and cast back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loom.comm.compression.base import (
    Collective,
    Exchange,
    check_codec_state,
    check_layout,
    layout_signature,
)

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
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be an int >= 1, got {rank!r}")
        self.rank = rank
        self.seed = int(seed)
        self.spec = f"powersgd:{rank}"
        self._residuals: dict[int, torch.Tensor] = {}
        self._qs: dict[int, list[torch.Tensor]] = {}
        self._layouts: dict[int, str] = {}

    def plan(self, shapes: Sequence[torch.Size]) -> list[_Segment]:
        """Which tensors are compressed, and as which matrices (public for tests and byte estimates)."""
        segments, offset = [], 0
        for shape in shapes:
            numel = int(torch.Size(shape).numel())
            rows = int(shape[0]) if len(shape) >= 2 else 0
            cols = numel // rows if rows else 0
            r = min(self.rank, rows, cols)
            if rows and (rows + cols) * r < rows * cols:
                segments.append(_Segment(offset, numel, rows, cols, r))
            else:
                segments.append(_Segment(offset, numel))
            offset += numel
        return segments

    def compressed_numel(self, shapes: Sequence[torch.Size]) -> int:
        """Numbers sent per rank and step for a bucket of ``shapes`` (both all-reduces together)."""
        return sum((s.rows + s.cols) * s.rank if s.compressed else s.numel for s in self.plan(shapes))

    def exchange(
        self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size], world_size: int
    ) -> Exchange:
        check_layout(flat, shapes)
        segments = self.plan(shapes)
        work_dtype = flat.dtype if flat.element_size() >= 4 else torch.float32
        self._forget_if_layout_changed(key, flat, shapes)
        accumulated = flat.to(work_dtype, copy=True)
        if key in self._residuals:
            accumulated += self._residuals[key]
        plain = [s for s in segments if not s.compressed]
        packed = [s for s in segments if s.compressed]
        matrices = [accumulated[s.offset : s.offset + s.numel].view(s.rows, s.cols) for s in packed]
        qs = self._qs.get(key) or [self._initial_q(key, i, s) for i, s in enumerate(packed)]
        qs = [q.to(work_dtype) for q in qs]

        ps = [m @ q for m, q in zip(matrices, qs, strict=True)]
        first = [accumulated[s.offset : s.offset + s.numel] for s in plain] + [p.reshape(-1) for p in ps]
        summed = yield Collective("sum", torch.cat(first), final=not packed)

        out = torch.empty_like(accumulated)
        cursor = 0
        for s in plain:
            out[s.offset : s.offset + s.numel] = summed[cursor : cursor + s.numel] / world_size
            cursor += s.numel
        if not packed:
            return out.to(flat.dtype)
        orthonormal = []
        for s in packed:
            p = summed[cursor : cursor + s.rows * s.rank].view(s.rows, s.rank)
            orthonormal.append(_orthonormalize(p))
            cursor += s.rows * s.rank

        new_qs = [m.T @ p for m, p in zip(matrices, orthonormal, strict=True)]
        # Error feedback with this rank's own approximation P Q_i^T (Algorithm 2 of the paper), i.e. what the
        # shared subspace misses of *this* rank's matrix. Subtracting the averaged P Q^T instead (as PyTorch's
        # powerSGD_hook does) would also keep each rank's deviation from the mean: it cancels in the average but
        # adds up, step after step, in every residual.
        residual = torch.zeros_like(accumulated)
        for s, m, p, q in zip(packed, matrices, orthonormal, new_qs, strict=True):
            residual[s.offset : s.offset + s.numel] = (m - p @ q.T).reshape(-1)
        summed = yield Collective("sum", torch.cat([q.reshape(-1) for q in new_qs]), final=True)

        cursor, kept = 0, []
        for s, p in zip(packed, orthonormal, strict=True):
            q = summed[cursor : cursor + s.cols * s.rank].view(s.cols, s.rank) / world_size
            cursor += s.cols * s.rank
            out[s.offset : s.offset + s.numel] = (p @ q.T).reshape(-1)
            kept.append(q.clone() if bool(torch.isfinite(q).all()) and q.abs().sum() > 0 else None)
        self._residuals[key] = residual
        self._qs[key] = [
            q if q is not None else self._initial_q(key, i, packed[i]) for i, q in enumerate(kept)
        ]
        return out.to(flat.dtype)

    def _initial_q(self, key: int, index: int, segment: _Segment) -> torch.Tensor:
        """The same random m x r matrix on every rank: seeded by (seed, bucket key, compressed tensor index)."""
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + key * 10_007 + index) % (2**63 - 1)
        )
        q = torch.randn(segment.cols, segment.rank, generator=generator)
        return q / math.sqrt(segment.cols)

    def _forget_if_layout_changed(self, key: int, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> None:
        layout = layout_signature(flat, shapes)
        if self._layouts.get(key) != layout:
            self._residuals.pop(key, None)
            self._qs.pop(key, None)
            self._layouts[key] = layout

    def state_dict(self) -> dict[str, Any]:
        buckets = {}
        for key, layout in self._layouts.items():
            bucket: dict[str, Any] = {"layout": layout}
            if key in self._residuals:
                bucket["residual"] = self._residuals[key].clone()
            if key in self._qs:
                bucket["q"] = [q.clone() for q in self._qs[key]]
            buckets[str(key)] = bucket
        return {"codec": self.spec, "seed": self.seed, "buckets": buckets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_codec_state(state, self.spec)
        self.seed = int(state.get("seed", self.seed))
        buckets = state["buckets"]
        self._layouts = {int(k): str(b["layout"]) for k, b in buckets.items()}
        self._residuals = {int(k): b["residual"].clone() for k, b in buckets.items() if "residual" in b}
        self._qs = {int(k): [q.clone() for q in b["q"]] for k, b in buckets.items() if "q" in b}

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
