"""An own loop that evaluates without ``torch.no_grad()`` (Horovod's MNIST example) and reads a model attribute
through nanoGPT's ``raw_model = model.module if ddp else model`` (``raw_model.estimate_mfu``).

``idioms_own_loop.py OUT.safetensors``: 2 epochs of a small classifier on loom's `DataParallel` through
``job.own_loop``; after each epoch, ``model.eval()`` and a forward on the whole test set with gradients enabled
and no backward (its size is not this rank's share of a training batch); then a backward through such a call,
which loom refuses, naming ``torch.no_grad()``. Rank 0 writes the final parameters to OUT. Run by
tests/test_idioms.py at 2 processes; the reference is this script as one process.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import TensorDataset

import loom


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(torch.relu(self.fc1(x))), dim=1)

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float) -> float:
        """nanoGPT's method's shape: a figure from the parameter count."""
        return sum(p.numel() for p in self.parameters()) * fwdbwd_per_iter / dt


def main(out: str | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    topo = loom.init()
    ddp = topo.is_distributed
    generator = torch.Generator().manual_seed(0)
    train = TensorDataset(
        torch.randn(30, 4, generator=generator), torch.randint(0, 3, (30,), generator=generator)
    )
    test_x, test_y = torch.randn(11, 4, generator=generator), torch.randint(0, 3, (11,), generator=generator)
    torch.manual_seed(0)
    model = Net()
    job = loom.DataParallel().setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    model, optimizer, loader = job.own_loop(job.loader(train, global_batch_size=8, seed=0))
    raw_model = model.module if ddp else model  # nanoGPT
    lines = [f"mfu {raw_model.estimate_mfu(2, 1.0):.1f} module {model.module is job.module}"]
    for _epoch in range(2):
        model.train()
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        model.eval()  # Horovod's test(): no torch.no_grad()
        output = model(test_x)
        lines.append(f"test loss {F.nll_loss(output, test_y, reduction='sum').item():.6f}")
    if ddp:
        try:
            F.nll_loss(model(test_x), test_y).backward()
            lines.append("backward through an evaluation call: accepted")
        except ValueError as error:
            lines.append(
                f"backward through an evaluation call: refused, naming no_grad {'no_grad' in str(error)}"
            )
    state = {k: v.detach().clone().contiguous() for k, v in job.module.state_dict().items()}
    if out is not None and topo.is_main:
        save_file(state, out)
    return state, lines


if __name__ == "__main__":
    _, lines = main(sys.argv[1])
    print("\n".join(lines), flush=True)
