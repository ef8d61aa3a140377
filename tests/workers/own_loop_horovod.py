"""Horovod's PyTorch MNIST example, its model setup and ``train(epoch)`` loop kept, on loom's `DataParallel`.

``own_loop_horovod.py OUT.safetensors``: horovod/examples/pytorch/pytorch_mnist.py on synthetic 28x28 images.
`ORIGINAL_LOOP` is its setup of the model and optimizer (the ``hvd`` lines) and its ``train`` loop as published;
the ``port`` block is the ported one, which the test diffs against it. ``lr_scaler`` is 1: Horovod scales the
learning rate with the workers because its global batch grows with them, loom's global batch is fixed.
Outside it: ``loom.init`` for ``hvd.init``, and the ``Net`` has no dropout (its masks come from each process's
RNG, so no distributed run can equal one process with it). Rank 0 writes the final parameters to OUT.

Run by tests/test_own_loop.py (2 processes; the reference is one process).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn, optim
from torch.utils.data import TensorDataset

import loom

ORIGINAL_LOOP = """
model = Net()
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_sampler),
                100. * batch_idx / len(train_loader), loss.item()))
"""

args = SimpleNamespace(lr=0.05, momentum=0.5, batch_size=9, log_interval=2, epochs=2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        return F.log_softmax(self.fc2(x), dim=1)


def main(out: str | None = None) -> dict[str, torch.Tensor]:
    loom.init()
    torch.manual_seed(42)
    generator = torch.Generator().manual_seed(0)
    train_dataset = TensorDataset(torch.randn(40, 1, 28, 28, generator=generator),
                                  torch.randint(0, 10, (40,), generator=generator))  # fmt: skip

    # >>> port
    # fmt: off
    model = Net()
    lr_scaler = 1
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    job = loom.DataParallel().setup(model, optimizer)
    model, optimizer, train_loader = job.own_loop(job.loader(train_dataset, args.batch_size))
    train_sampler = train_loader.sampler


    def train(epoch):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(  # noqa: UP032
                    epoch, batch_idx * len(data), len(train_sampler),
                    100. * batch_idx / len(train_loader), loss.item()))
    # fmt: on
    # <<< port

    for epoch in range(1, args.epochs + 1):
        train(epoch)
    state = {k: v.detach().clone().contiguous() for k, v in job.module.state_dict().items()}
    if out is not None and loom.current().is_main:
        save_file(state, out)
    return state


if __name__ == "__main__":
    main(sys.argv[1])
    print(f"rank {loom.current().rank} done", flush=True)
