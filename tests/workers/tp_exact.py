"""Tensor parallel, t = world size: an MLP block and a transformer block against their unsplit copies.

Prints one JSON line per block: max |Δ| of outputs, input gradients and parameter gradients (each shard against
its slice of the full gradient), and the all-reduces counted in forward and backward.

Run by tests/test_tensor_parallel.py.
"""

import copy
import json

import torch
from torch import nn

import loom
from loom.examples.char_gpt import Block
from loom.mesh import Mesh
from loom.parallel.tensor.tensor_parallel_layers import TensorParallelComm
from loom.parallel.tensor.tensor_parallel_shard import apply_tensor_parallel

topo = loom.init()
mesh = Mesh(tp=topo.world_size)
comm = TensorParallelComm(mesh.group("tp"), mesh.index("tp"), mesh.size("tp"))
blocks = {
    "mlp": lambda: nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)),
    "transformer": lambda: Block(16, 4),
}
for name, make in blocks.items():
    torch.manual_seed(0)
    full = make()
    split = copy.deepcopy(full)
    dims = apply_tensor_parallel(split, "auto", comm)
    x = torch.randn(3, 5, 16)
    upstream = torch.randn(3, 5, 16)
    x_full, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    (full(x_full) * upstream).sum().backward()
    comm.reset_counts()
    out = split(x_split)
    forward_count = comm.counts["forward"]
    (out * upstream).sum().backward()
    grads = 0.0
    for p_full, p_split in zip(full.parameters(), split.parameters(), strict=True):
        expected = p_full.grad
        if id(p_split) in dims:
            expected = expected.chunk(comm.size, dim=dims[id(p_split)])[comm.rank]
        grads = max(grads, (p_split.grad - expected).abs().max().item())
    record = {
        "block": name,
        "output": (out - full(x)).abs().max().item(),
        "input_grad": (x_split.grad - x_full.grad).abs().max().item(),
        "param_grad": grads,
        "forward_all_reduces": forward_count,
        "backward_all_reduces": comm.counts["backward"],
    }
    print(json.dumps(record), flush=True)
