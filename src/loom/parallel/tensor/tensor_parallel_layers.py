"""Megatron-style tensor-parallel layers and the two collectives they are built from.

Megatron-LM (Shoeybi et al. 2019, §3) splits an MLP ``Y = GeLU(X A) B`` by columns of ``A`` and rows of ``B``:
each of ``t`` processes computes ``GeLU(X A_i) B_i`` with no communication in between, and one all-reduce sums
the partial outputs. Two conjugate operators make the autograd right:

- ``f`` (`copy_to_parallel`): identity forward, all-reduce of the input gradient backward — at a block's input;
- ``g`` (`reduce_from_parallel`): all-reduce forward, identity backward — at a row-parallel layer's output.

So a block costs one all-reduce forward and one backward, counted by its `TensorParallelComm`. They are small
(a micro-batch's activations) and latency-bound, so on one host (decided once, the same on every process, by the
group's first all-reduce) they go through shared memory (`loom.comm.shm_small`, `loom.comm.shm` above its
``MAX_BYTES``); across hosts, and for GPU tensors, the backend's.

Sharding is *in place*: a split layer keeps the very ``nn.Parameter`` objects of the original (their data
narrowed to this process's shard), so an optimizer built on the unsplit model keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from loom.comm import shm_small
from loom.comm._reduce import backend_name
from loom.comm.all_reduce import all_reduce as loom_all_reduce

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelComm",
    "VocabParallelEmbedding",
    "copy_to_parallel",
    "reduce_from_parallel",
]


@dataclass
class TensorParallelComm:
    """The tensor-parallel group of this process, its index in it, and counts of the collectives run."""

    group: Any
    """Process group of the ``tp`` axis (``None``: a group of one, collectives are skipped)."""
    rank: int
    """This process's shard index, 0 ≤ rank < size."""
    size: int
    counts: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    """All-reduces run in forward and in backward since the last `reset_counts`."""
    _local: Any = field(default=False, init=False, repr=False, compare=False)
    """`shm_small.SmallAllReduce` of the group when it is all on one host; None if not; False before the first
    all-reduce (which decides, collectively)."""

    def all_reduce(self, tensor: torch.Tensor, phase: str) -> torch.Tensor:
        """Sum ``tensor`` over the group in place; return it."""
        self.counts[phase] += 1
        local = self._local_for(tensor)
        if local is None:
            if self.group is not None:
                dist.all_reduce(tensor, group=self.group)
        elif tensor.nbytes <= shm_small.MAX_BYTES and tensor.is_contiguous():
            local.all_reduce(tensor)
        else:
            loom_all_reduce(tensor, "sum", "shm", self.group)
        return tensor

    def reduced(self, tensor: torch.Tensor, phase: str) -> torch.Tensor:
        """The sum of ``tensor`` over the group as a new tensor; ``tensor`` is left as it is."""
        local = self._local_for(tensor)
        if local is not None and tensor.nbytes <= shm_small.MAX_BYTES:
            self.counts[phase] += 1
            return local.reduced(tensor.contiguous())
        return self.all_reduce(tensor.contiguous().clone(), phase)

    def _local_for(self, tensor: torch.Tensor) -> shm_small.SmallAllReduce | None:
        """The group's shared-memory all-reduce if ``tensor`` can take it (decided on the first call)."""
        if self.group is None or tensor.device.type != "cpu" or backend_name(self.group) != "gloo":
            return None
        if self._local is False:
            self._local = shm_small.SmallAllReduce.for_group(self.group)
        return self._local

    def reset_counts(self) -> None:
        self.counts = {"forward": 0, "backward": 0}


class _CopyToParallel(torch.autograd.Function):
    """The ``f`` operator of Megatron-LM: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.reduced(grad, "backward"), None


class _ReduceFromParallel(torch.autograd.Function):
    """The ``g`` operator of Megatron-LM: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.reduced(x, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


copy_to_parallel = _CopyToParallel.apply
reduce_from_parallel = _ReduceFromParallel.apply


def _shard_(param: torch.Tensor, dim: int, comm: TensorParallelComm, what: str) -> None:
    size = param.shape[dim]
    if size % comm.size:
        raise ValueError(
            f"tensor parallelism of size {comm.size} cannot split {what} of size {size} (dim {dim} of shape "
            f"{tuple(param.shape)}). HINT: choose a tensor-parallel size that divides {size}."
        )
    with torch.no_grad():
        param.data = param.data.chunk(comm.size, dim=dim)[comm.rank].clone()


class ColumnParallelLinear(nn.Module):
    """``y_i = x A_iᵀ + b_i``: this process's slice of the output features (no communication)."""

    def __init__(self, linear: nn.Linear, comm: TensorParallelComm, what: str = "out_features") -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.comm = comm
        _shard_(self.weight, 0, comm, what)
        if self.bias is not None:
            _shard_(self.bias, 0, comm, what)
        self.shard_dims = {id(self.weight): 0, **({id(self.bias): 0} if self.bias is not None else {})}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = g(Σ_i x_i B_iᵀ) + b``: this process's slice of the input features, summed by one all-reduce."""

    def __init__(self, linear: nn.Linear, comm: TensorParallelComm, what: str = "in_features") -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.comm = comm
        _shard_(self.weight, 1, comm, what)
        self.shard_dims = {id(self.weight): 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_parallel(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """This process's rows of the vocabulary; ids outside them look up zeros, one all-reduce sums the parts."""

    def __init__(self, embedding: nn.Embedding, comm: TensorParallelComm) -> None:
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding does not support padding_idx or max_norm")
        self.weight = embedding.weight
        self.comm = comm
        _shard_(self.weight, 0, comm, "the vocabulary (num_embeddings)")
        self.start = comm.rank * self.weight.shape[0]
        self.shard_dims = {id(self.weight): 0}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_parallel(out, self.comm)
