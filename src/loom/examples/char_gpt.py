"""A small GPT-style character model trained with `Hybrid` parallelism.

    loom run -n 4 -m loom.examples.char_gpt --dp 2 --tp 2        # or --dp 2 --pp 2, or --pp 2 --tp 2

The model is written as a *chain* (``embed → blocks.0 … blocks.k → head``) so a pipeline can cut it anywhere,
and its blocks use the patterns `TensorParallel`'s ``"auto"`` plan recognises: attention with ``q_proj``,
``k_proj``, ``v_proj``, ``out_proj`` and ``n_heads``, and an MLP of two linears (Radford et al. 2019's GPT-2
block, pre-norm). The text is generated, so the example needs no download.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
from torch import nn
from torch.nn import functional as F

import loom

__all__ = ["Block", "CausalSelfAttention", "CharGPT", "Embed", "Head", "char_dataset", "lm_loss"]


class Embed(nn.Module):
    """Token plus position embeddings."""

    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; ``n_heads`` is read in forward, so a tensor-parallel split can lower it."""

    def __init__(self, width: int, n_heads: int) -> None:
        super().__init__()
        if width % n_heads:
            raise ValueError(f"width {width} is not divisible by n_heads {n_heads}")
        self.n_heads, self.head_dim = n_heads, width // n_heads
        self.q_proj, self.v_proj = nn.Linear(width, width), nn.Linear(width, width)
        # No key bias: it adds the same score to every key of a query, which softmax ignores, so its gradient is
        # zero up to rounding, and Adam would turn that rounding into full-size steps.
        self.k_proj = nn.Linear(width, width, bias=False)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(proj: nn.Module) -> torch.Tensor:
            return proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.out_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class Block(nn.Module):
    """Pre-norm transformer layer: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, width: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, n_heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final layer norm and the projection to vocabulary logits."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class CharGPT(nn.Module):
    """``embed → blocks → head``, a chain a pipeline can cut between any two of them."""

    def __init__(
        self, vocab: int = 32, width: int = 32, n_heads: int = 4, layers: int = 2, context: int = 16
    ):
        super().__init__()
        self.embed = Embed(vocab, width, context)
        self.blocks = nn.ModuleList([Block(width, n_heads) for _ in range(layers)])
        self.head = Head(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def char_dataset(context: int = 16, samples: int = 256, vocab: int = 32) -> torch.utils.data.TensorDataset:
    """Windows of a generated text (repeated phrases over a ``vocab``-letter alphabet), shifted by one."""
    text = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 40
    alphabet = sorted(set(text))
    if len(alphabet) > vocab:
        raise ValueError(f"the text has {len(alphabet)} distinct characters, more than vocab={vocab}")
    ids = torch.tensor([alphabet.index(c) for c in text])
    starts = torch.arange(samples) * 7 % (len(ids) - context - 1)
    x = torch.stack([ids[s : s + context] for s in starts])
    y = torch.stack([ids[s + 1 : s + context + 1] for s in starts])
    return torch.utils.data.TensorDataset(x, y)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for axis in ("dp", "pp", "tp"):
        parser.add_argument(f"--{axis}", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    topo = loom.init()
    torch.manual_seed(0)
    model = CharGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    strategy = loom.Hybrid(dp=args.dp, pp=args.pp, tp=args.tp, microbatches=args.microbatches)
    job = strategy.setup(model, optimizer, lm_loss)
    loader = job.loader(char_dataset(), args.batch, seed=0)  # sharded over the data axis only
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
    for step, batch in enumerate(itertools.islice(batches, args.steps), start=1):
        loss = job.train_step(batch)
        if topo.is_main and (step % 10 == 0 or step == 1):
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    full = job.full_state_dict()
    if full is not None:
        print(
            f"trained {sum(t.numel() for t in full.values())} parameters on mesh {job.mesh.shape.describe()}"
        )


if __name__ == "__main__":
    main()
