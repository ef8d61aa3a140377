"""A Horovod elastic script (``hvd.elastic.run`` + ``TorchState``) that loses rank 1 to SIGKILL mid-epoch.

``horovod_elastic.py OUT.safetensors``, under ``loom run -n 2 --max-restarts 1``: 3 epochs of 6 batches,
``state.commit()`` after every second batch. On the first attempt rank 1 kills itself before epoch 1,
batch 3; the restarted job must resume from the last commit (epoch 1, batch 2), run its reset callbacks, and
end with the parameters of an uninterrupted run (tests/test_horovod_elastic.py computes them in one
process). Rank 0 prints ``START attempt epoch batch`` for each attempt, ``RESET attempt`` from the callback,
and writes the final parameters.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from safetensors.torch import save_file

import loom.horovod as hvd

EPOCHS, BATCHES, GLOBAL_BATCH = 3, 6, 8
KILL_AT = (1, 3)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def batch(epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * epoch + index)
    return torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


def main(out: str) -> None:
    hvd.init()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks(
        [lambda: print(f"RESET {attempt}", flush=True) if hvd.rank() == 0 else None]
    )
    share = GLOBAL_BATCH // hvd.size()

    @hvd.elastic.run
    def train(state) -> None:
        if hvd.rank() == 0:
            print(f"START {attempt} {state.epoch} {state.batch}", flush=True)
        for epoch in range(state.epoch, EPOCHS):
            state.epoch = epoch
            for index in range(state.batch, BATCHES):
                if attempt == 0 and hvd.rank() == 1 and (epoch, index) == KILL_AT:
                    os.kill(os.getpid(), signal.SIGKILL)
                x, y = batch(epoch, index)
                rows = slice(hvd.rank() * share, (hvd.rank() + 1) * share)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
                optimizer.step()
                state.batch = index + 1
                if index % 2 == 1:
                    state.commit()
            state.batch = 0

    train(state)
    if hvd.rank() == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
