"""A DDP script in the form of PyTorch's ddp-tutorial-series ``multigpu_torchrun.py`` (our own code, written in
its shape): ``ddp_setup()`` calls ``init_process_group()`` itself, a ``Trainer`` wraps the model in ``DDP`` and
reads a ``DistributedSampler`` loader, and ``main`` ends with ``destroy_process_group()``. On the CPU with gloo,
as the tutorial runs without GPUs. Nothing in it knows loom.

``torchrun_tutorial.py EPOCHS OUT.safetensors [--fail-on-first-attempt RANK] [--init tcp|env|default]``: rank 0
writes the final parameters to OUT. ``--fail-on-first-attempt`` makes that rank exit with status 3 after its first
epoch on restart attempt 0 (``TORCHELASTIC_RESTART_COUNT``), to test a restarted group. ``--init tcp`` passes
``init_method=f"tcp://{MASTER_ADDR}:{MASTER_PORT}"`` (rank and world size from the environment), ``env`` passes
``"env://"``, ``default`` (the default) passes nothing.

Run by tests/test_script_init.py under ``loom run`` and under ``torchrun`` (python -m torch.distributed.run).
"""

# ruff: noqa
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RandomPairs(Dataset):
    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 20, generator=generator)
        self.y = torch.randint(0, 3, (size,), generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def ddp_setup(how):
    if how == "tcp":
        addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        init_process_group(
            backend="gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    elif how == "env":
        init_process_group(backend="gloo", init_method="env://")
    else:
        init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, fail_rank):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.fail_rank = fail_rank

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)
        print(f"[rank {torch.distributed.get_rank()}] epoch {epoch} done", flush=True)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if first_attempt and torch.distributed.get_rank() == self.fail_rank:
                sys.exit(3)  # a crash after one epoch; the restarted group starts again from scratch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("epochs", type=int)
    parser.add_argument("out")
    parser.add_argument("--fail-on-first-attempt", type=int, default=-1)
    parser.add_argument("--init", default="default", choices=["default", "env", "tcp"])
    args = parser.parse_args()
    ddp_setup(args.init)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = RandomPairs(96)
    loader = DataLoader(dataset, batch_size=8, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer, args.fail_on_first_attempt)
    trainer.train(args.epochs)
    if torch.distributed.get_rank() == 0:
        state = trainer.model.module.state_dict()
        save_file({k: v.detach().clone() for k, v in state.items()}, args.out)
    destroy_process_group()


if __name__ == "__main__":
    main()
