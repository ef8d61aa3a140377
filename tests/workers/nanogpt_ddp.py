"""A nanoGPT-style ``train.py`` as published, DDP structure kept (karpathy/nanoGPT), shrunk to run on CPU in
seconds: the unmodified script that `nanogpt_port.py` ports to loom. Runs under ``torchrun`` (DDP) or plain
python. ``nanogpt_ddp.py OUT.safetensors [REPLAY.json]`` (see `nanogpt_port.py` for the test hooks). Run by
tests/test_idioms.py.
"""

# ruff: noqa
# --- nanoGPT train.py ---
import os
import sys
import json
import time
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group
from safetensors.torch import save_file
from nanogpt_model import GPT, VOCAB, BLOCK

out_path = sys.argv[1]
replay = sys.argv[2] if len(sys.argv) > 2 else None
eval_interval, eval_iters, max_iters, log_interval = 2, 2, 4, 1
gradient_accumulation_steps = 4
batch_size, block_size = 3, BLOCK
learning_rate, weight_decay, beta1, beta2, grad_clip = 1e-2, 0.1, 0.9, 0.95, 1.0
backend = "gloo"
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
print(f"tokens per iteration will be: {tokens_per_iter:,}")
torch.manual_seed(1337 + seed_offset)
data = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(7))
train_data, val_data = data[:320], data[320:]
drawn, replayed = [], (json.load(open(replay)) if replay else None)


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    if split == "train" and torch.is_grad_enabled():  # test hook: record (or replay) the training draws
        ix = torch.tensor(replayed.pop(0)) if replayed is not None else ix
        drawn.append(ix.tolist())
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


model = GPT()
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
if ddp:
    model = DDP(model)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


X, Y = get_batch("train")
t0 = time.time()
iter_num = 0
raw_model = model.module if ddp else model
while True:
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        mfu = raw_model.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {mfu * 100:.2f}%")
    iter_num += 1
    if iter_num > max_iters:
        break

if master_process:
    save_file({k: v.detach().clone() for k, v in raw_model.state_dict().items()}, out_path)
json.dump(drawn, open(f"{out_path}.rank{int(os.environ.get('RANK', 0))}.json", "w"))
if ddp:
    destroy_process_group()
