"""ShardedDataParallel(mixed_precision=...) at stages 2 and 3 against one float32 process; run by
tests/test_sharded.py.

Every rank trains the shared MLP for 6 Adam steps with bf16 and fp16 compute and prints one JSON line per run:
the largest difference of the losses and of the gathered parameters from a float32 single-process reference on
the same global batches, and the dtype of the master weights after training.
"""

import json

import torch
from common import make_dataset, make_mlp
from torch import nn

import loom
from loom.data import GlobalBatchSampler

GLOBAL_BATCH, STEPS = 4, 6
topo = loom.init()
data = make_dataset()


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for batch in GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=1):
        x, y = data[batch.indices]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if len(losses) == STEPS:
            return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    raise AssertionError("the data set is too small for the steps")


ref_losses, ref_params = reference()
for stage in (2, 3):
    for precision in ("bf16", "fp16"):
        model = make_mlp()
        job = loom.ShardedDataParallel(stage=stage, mixed_precision=precision).setup(
            model, torch.optim.Adam(model.parameters(), lr=0.01), nn.functional.mse_loss
        )
        losses = []
        for batch in job.loader(data, GLOBAL_BATCH, seed=1):
            losses.append(job.train_step(batch))
            if len(losses) == STEPS:
                break
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        print(json.dumps({
            "rank": topo.rank, "stage": stage, "precision": precision,
            "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "params": max((full[k].float() - v).abs().max().item() for k, v in ref_params.items()),
            "master": sorted({str(p.dtype) for p in model.parameters()}),
        }), flush=True)  # fmt: skip
