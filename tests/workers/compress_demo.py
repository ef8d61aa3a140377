"""Train the digits CNN under plain DDP once per gradient codec (and once uncompressed); print one JSON line.

Usage: compress_demo.py EPOCHS BUCKET_CAP_MB CODEC... ("none" is loom's native all-reduce hook, the baseline
whose bytes are counted the same way). Every run starts from the same weights and sees the same batches.
Output per codec: test accuracy, this rank's gradient bytes sent/received (loom.comm.counters), a checksum
of the final parameters (replicas must agree), the codec's state_dict keys, and the wall time.

Run by tests/test_compression.py.
"""

import json
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import loom
from loom import comm
from loom.comm.compression import compression_hook
from loom.demo.train import accuracy, digits_cnn, digits_datasets

torch.set_num_threads(1)
epochs, bucket_cap_mb, codecs = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
topo = loom.init()
train_set, test_set = digits_datasets()
x_test, y_test = test_set.tensors
result = {"rank": topo.rank, "runs": {}}


def test_accuracy(model: nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        value = float(accuracy(model(x_test), y_test))
    model.train()
    return value


for spec in codecs:
    started = time.perf_counter()
    model = digits_cnn()
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    hook = comm.allreduce_hook("native") if spec == "none" else compression_hook(spec)
    ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_loader = loom.data.loader(train_set, 64, seed=0)
    comm.counters().reset()
    curve = []
    for epoch in range(epochs):
        train_loader.set_epoch(epoch)
        for x, y in train_loader:  # equal shares (64 = 2 x 32, last batch 30 = 2 x 15): DDP's mean is exact
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        curve.append(test_accuracy(model))
    counted = comm.counters().snapshot()
    result["runs"][spec] = {
        "accuracy": curve[-1],
        "curve": curve,
        "bytes_sent": counted["bytes_sent"],
        "bytes_received": counted["bytes_received"],
        "ops": counted["ops"],
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
        "state_keys": [] if spec == "none" else sorted(hook.state_dict()),
        "seconds": time.perf_counter() - started,
    }
result["param_bytes"] = sum(p.nbytes for p in digits_cnn().parameters())
print(json.dumps(result))
