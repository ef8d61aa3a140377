"""The baseline for `horovod_mnist`: the same model, data, sampler, learning-rate scaling and metrics, written
with plain PyTorch DistributedDataParallel for ``torchrun`` (no Horovod, no loom).

    torchrun --nproc-per-node 2 src/loom/examples/horovod_mnist_ddp.py --epochs 5

Used by ``python -m loom_bench.horovod_suite --throughput`` to measure what a Horovod user moving to loom
gains or loses against DDP. Rank 0 prints the test accuracy after each epoch and the training time.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from loom.examples.horovod_mnist import Net, digits

parser = argparse.ArgumentParser(description="digits with DistributedDataParallel")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)


def main(args) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_dataset, test_dataset = digits(train=True), digits(train=False)
    train_sampler: DistributedSampler = DistributedSampler(train_dataset, num_replicas=size, rank=rank)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler: DistributedSampler = DistributedSampler(test_dataset, num_replicas=size, rank=rank)
    test_loader = DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)
    model = DistributedDataParallel(Net())  # broadcasts rank 0's parameters
    optimizer = optim.SGD(model.parameters(), lr=args.lr * size, momentum=args.momentum)
    start = time.perf_counter()
    samples = 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
            samples += len(data)
        model.eval()
        correct = torch.zeros(1)
        with torch.no_grad():
            for data, target in test_loader:
                correct += (model(data).argmax(1) == target).sum()
        accuracy = correct / len(test_sampler)
        dist.all_reduce(accuracy, group=dist.group.WORLD)
        if rank == 0:
            print(f"Test set: Accuracy: {100.0 * accuracy.item() / size:.2f}%")
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"Training time: {elapsed:.3f} s for {samples * size} samples")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main(parser.parse_args())
