"""nanoGPT's training loop kept as written, on loom's `DataParallel` through ``job.own_loop``.

``own_loop_gpt.py OUT.safetensors DTYPE OPTIMIZER``: trains a tiny nanoGPT-style character model (karpathy/nanoGPT ``model.py``:
``logits, loss = model(idx, targets)``, tied embeddings) with nanoGPT's ``train.py`` loop: bf16 autocast,
GradScaler, gradient accumulation with ``require_backward_grad_sync``, clipping after ``unscale_``, an LR schedule
written into the param groups, and a master-only ``estimate_loss`` (rank 0 evaluates alone, under no_grad).
`ORIGINAL_LOOP` is that loop as published (CUDA specifics aside: CPU autocast, ``torch.amp.GradScaler("cpu")``
enabled so it is exercised); the block between the ``port`` markers is the ported loop, which the test diffs
against it. What moved into the setup: ``loom.init`` and the strategy replace ``init_process_group``;
``get_batch`` draws from ``job.loader`` (global batches of ``GLOBAL_BATCH`` samples, whatever the world size)
instead of random offsets; ``gradient_accumulation_steps`` is not divided by the world size, since every loader
batch is already a global one. Rank 0 writes the final parameters to OUT.

DTYPE is nanoGPT's ``dtype`` (``bfloat16``: autocast; ``float32``: none). OPTIMIZER: ``adamw`` is nanoGPT's;
``sgd`` (momentum 0.9) is what the bf16 comparison uses: under autocast every rank's weight gradient is a bf16
matmul over its share, rounded to bf16 (relative 2^-8) before the average, as with DDP, and AdamW divides each
gradient by its own running size, turning that rounding on near-zero gradients into lr-sized steps (measured
up to 6.6e-4 against one process with AdamW, 6e-7 with SGD, 6e-8 in float32 with AdamW).

Run by tests/test_own_loop.py (2 processes; the reference is the same script as one process, also under
autocast).
"""

from __future__ import annotations

import math
import sys

import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import loom

ORIGINAL_LOOP = """
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])
raw_model = model.module if ddp else model
X, Y = get_batch('train')
iter_num = 0
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch('train')
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num > max_iters:
        break
"""

BLOCK, VOCAB, GLOBAL_BATCH = 16, 24, 7
dtype, OPTIMIZER = "bfloat16", "sgd"
learning_rate, min_lr, warmup_iters, lr_decay_iters, decay_lr = 1e-3, 1e-4, 2, 6, True
max_iters, eval_interval, eval_iters, gradient_accumulation_steps, grad_clip = 4, 2, 2, 2, 1.0


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = (
            nn.Linear(n_embd, 3 * n_embd, bias=False),
            nn.Linear(n_embd, n_embd, bias=False),
        )
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd, bias=False), CausalSelfAttention(n_embd, n_head)
        self.ln_2, up = nn.LayerNorm(n_embd, bias=False), nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.mlp = nn.Sequential(up, nn.GELU(), nn.Linear(4 * n_embd, n_embd, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT, small, with its ``bias=False`` option (a key bias has a zero gradient up to rounding,
    which Adam would turn into full-size steps that differ between any two summation orders):
    ``forward(idx, targets)`` returns ``(logits, loss)``; wte and lm_head are tied."""

    def __init__(self, n_layer: int = 2, n_head: int = 2, n_embd: int = 32) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, n_embd), nn.Embedding(BLOCK, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd, bias=False), nn.Linear(n_embd, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple
    ) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        if OPTIMIZER == "sgd":
            return torch.optim.SGD(groups, lr=learning_rate, momentum=0.9)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


class Windows(Dataset):
    """nanoGPT's ``x = data[i:i+block]``, ``y = data[i+1:i+1+block]`` at every offset of a generated text."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data) - BLOCK - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i : i + BLOCK], self.data[i + 1 : i + 1 + BLOCK]


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = min(1.0, (it - warmup_iters) / (lr_decay_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def train(out: str | None = None) -> dict[str, torch.Tensor]:
    """The setup (changed for loom, see the module docstring), then the loop (the ``port`` block)."""
    text = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (200,), generator=text)
    train_data, val_data = Windows(data[:160]), Windows(data[160:])
    topo = loom.init()
    ddp, master_process = topo.is_distributed, topo.is_main
    torch.manual_seed(1337)
    model = GPT()
    optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95))
    job = loom.DataParallel().setup(model, optimizer)
    loader = job.loader(train_data, global_batch_size=GLOBAL_BATCH, seed=0)
    ctx = torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    batches = None

    def get_batch(split: str):
        nonlocal batches
        if split == "val":
            return next(iter(torch.utils.data.DataLoader(val_data, batch_size=4)))
        for _ in range(2):  # a new epoch when this one is used up
            batches = batches or iter(loader)
            try:
                return next(batches)
            except StopIteration:
                batches = None
        raise RuntimeError("the loader yields no batch")

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        raw_model.eval()
        out = {}
        for split in ("train", "val"):
            losses = [float(model(*get_batch("val"))[1]) for _ in range(eval_iters)]
            out[split] = sum(losses) / len(losses)
        raw_model.train()
        return out

    # >>> port
    # fmt: off
    model, optimizer, loader = job.own_loop(loader)
    raw_model = model.module if ddp else model
    X, Y = get_batch('train')
    iter_num = 0
    while True:
        lr = get_lr(iter_num) if decay_lr else learning_rate
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        if iter_num % eval_interval == 0 and master_process:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch('train')
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num > max_iters:
            break
    # fmt: on
    # <<< port
    state = {k: v.detach().clone().contiguous() for k, v in job.module.state_dict().items()}
    if out is not None and topo.is_main:
        save_file(state, out)
    return state


if __name__ == "__main__":
    dtype, OPTIMIZER = sys.argv[2], sys.argv[3]
    learning_rate = 5e-3 if OPTIMIZER == "sgd" else learning_rate
    train(sys.argv[1])
    print(f"rank {loom.current().rank} done", flush=True)
