"""compression_hook inside DDP against the same codecs run for simulated ranks in one process; print one JSON line.

Usage: compress_hook.py STEPS BUCKET_CAP_MB CODEC... Small buckets split the digits CNN into several, so the
hook's pipelining (PowerSGD's second round started by the next bucket's call) and DDP's bucket rebuild after
the first step are exercised. Every bucket the hook sees is recorded (parameter numbers, input, shapes and the
buffer it fills); after backward the inputs of all ranks are gathered and replayed with `exchange_locally` on
reference codecs (one per simulated rank, keeping their own residuals per parameter over the steps). Output per
codec: the largest difference between hook and reference (relative to the bucket's largest entry), in the
bucket buffers and in every parameter's ``.grad`` (so the buffer's offsets are checked too; DDP runs with
``gradient_as_bucket_view`` alternately on and off), bytes counted by the hook and by the reference, buckets
per step, and whether the hook codec's state_dict equals this rank's reference codec's.
Last, a codec that fails while decoding must make backward raise (not hang), naming the rank and the codec.

Run by tests/test_compression.py.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import loom
from loom import comm
from loom.comm.compression import compression_hook, exchange_locally, make_codec
from loom.demo.train import digits_cnn, digits_datasets

torch.set_num_threads(1)
steps, bucket_cap_mb, specs = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
topo = loom.init()
rank, n = topo.rank, topo.world_size
train_set, _ = digits_datasets()


class Recording:
    """A codec that remembers every bucket it is asked to exchange, then lets the real codec do it."""

    def __init__(self, codec):
        self.codec, self.spec, self.calls = codec, codec.spec, []

    def exchange(self, params, flat, shapes, world_size):
        self.calls.append((list(params), flat.clone(), [torch.Size(s) for s in shapes], flat))
        return (yield from self.codec.exchange(params, flat, shapes, world_size))

    def state_dict(self):
        return self.codec.state_dict()

    def load_state_dict(self, state):
        self.codec.load_state_dict(state)


def batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(100 * step + r))[:16]
    return train_set[index]


def same_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    return a == b


result = {"rank": rank, "runs": {}}
for i, spec in enumerate(specs):
    model = digits_cnn()
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=i % 2 == 1)
    recording = Recording(make_codec(spec))
    hook = compression_hook(recording)
    ddp.register_comm_hook(None, hook)
    references = [make_codec(spec) for _ in range(n)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    worst, worst_grad, hook_bytes, reference_bytes, buckets = 0.0, 0.0, 0, 0, []
    for step in range(steps):
        recording.calls.clear()
        before = comm.counters().snapshot()["bytes_sent"]
        optimizer.zero_grad()
        x, y = batch(step, rank)
        nn.functional.cross_entropy(ddp(x), y).backward()
        hook_bytes += comm.counters().snapshot()["bytes_sent"] - before
        buckets.append(len(recording.calls))
        for params, given, shapes, filled in recording.calls:
            inputs = [torch.empty_like(given) for _ in range(n)]
            dist.all_gather(inputs, given)
            averaged, sent = exchange_locally(references, inputs, shapes, params)
            reference_bytes += sent
            scale = float(averaged[rank].abs().max()) or 1.0
            worst = max(worst, float((filled - averaged[rank]).abs().max()) / scale)
            pieces = torch.split(averaged[rank], [s.numel() for s in shapes])
            for number, piece in zip(params, pieces, strict=True):
                grad = hook.parameters[number].grad.reshape(-1)
                worst_grad = max(worst_grad, float((grad - piece).abs().max()) / scale)
        optimizer.step()
    result["runs"][spec] = {
        "max_difference": worst,
        "max_grad_difference": worst_grad,
        "gradient_as_bucket_view": i % 2 == 1,
        "parameters_numbered": len(hook.parameters),
        "hook_bytes": hook_bytes,
        "reference_bytes": reference_bytes,
        "buckets_per_step": buckets,
        "same_state": same_state(recording.state_dict(), references[rank].state_dict()),
    }


class FailingDecode:
    spec = "failing"

    def exchange(self, params, flat, shapes, world_size):
        yield make_codec("fp16").exchange(params, flat, shapes, world_size).send(None)
        raise ValueError("decode failed on purpose")

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


ddp = DistributedDataParallel(digits_cnn(), bucket_cap_mb=bucket_cap_mb)
ddp.register_comm_hook(None, compression_hook(FailingDecode()))
x, y = batch(0, rank)
try:
    nn.functional.cross_entropy(ddp(x), y).backward()
    result["failure"] = "backward did not raise"
except RuntimeError as error:
    result["failure"] = str(error)
print(json.dumps(result))
