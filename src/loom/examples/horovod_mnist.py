"""Horovod's PyTorch MNIST example, run by loom: only the import line differs from a Horovod script.

    loom run -n 2 src/loom/examples/horovod_mnist.py       # was: horovodrun -np 2 python pytorch_mnist.py
    python src/loom/examples/horovod_mnist.py              # one process

Written from the documented behaviour of ``examples/pytorch/pytorch_mnist.py`` in the Horovod repository: the
same options and the same Horovod calls. Two changes, both because this machine has no internet: the data is
scikit-learn's bundled 8x8 digits (1,797 images; 80 % train, 20 % test) instead of downloaded MNIST, and the
convolutions are sized for 8x8 images. The ``--num-proc`` path through ``horovod.run`` is gone: ``loom run``
launches. Added: rank 0 prints the training time (for ``python -m loom_bench.horovod_suite --throughput``).

Horovod's defaults were tuned for MNIST's 60,000 images; on 1,437 an epoch is 23 steps, so at ``--lr 0.01`` the
accuracy climbs slowly (one process here: 41 % after 10 epochs); ``--lr 0.1`` reaches 96 % in 10 epochs.
"""

import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits

import loom.horovod as hvd

# Training settings
parser = argparse.ArgumentParser(description="PyTorch MNIST Example (digits)")
parser.add_argument("--batch-size", type=int, default=64, metavar="N", help="input batch size for training")
parser.add_argument(
    "--test-batch-size", type=int, default=1000, metavar="N", help="input batch size for testing"
)
parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR", help="learning rate")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
parser.add_argument("--log-interval", type=int, default=10, metavar="N", help="batches between log lines")
parser.add_argument(
    "--fp16-allreduce", action="store_true", default=False, help="fp16 compression in allreduce"
)
parser.add_argument(
    "--use-mixed-precision", action="store_true", default=False, help="mixed precision (CUDA)"
)
parser.add_argument("--use-adasum", action="store_true", default=False, help="use the Adasum reduction")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0, help="gradient predivide factor")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3)  # 8x8 -> 6x6, pooled to 3x3
        self.conv2 = nn.Conv2d(10, 20, kernel_size=2)  # 3x3 -> 2x2
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(80, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(self.conv2_drop(self.conv2(x)))
        x = x.view(-1, 80)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def digits(train: bool) -> torch.utils.data.TensorDataset:
    """scikit-learn's digits, normalized like the MNIST example's transform; a fixed 80/20 split."""
    images, labels = load_digits(return_X_y=True)
    order = np.random.RandomState(0).permutation(len(labels))
    cut = int(0.8 * len(labels))
    chosen = order[:cut] if train else order[cut:]
    x = torch.tensor(images[chosen], dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    x = (x - 0.3) / 0.4
    return torch.utils.data.TensorDataset(x, torch.tensor(labels[chosen], dtype=torch.int64))


def main(args):
    def train_mixed_precision(epoch, scaler):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            with torch.autocast("cuda"):
                output = model(data)
                loss = F.nll_loss(output, target)
            scaler.scale(loss).backward()
            optimizer.synchronize()  # all async allreduces done before unscaling
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
            if batch_idx % args.log_interval == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}"
                      f"\tLoss Scale: {scaler.get_scale()}")  # fmt: skip

    def train_epoch(epoch):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                print(
                    f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} ({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
                )  # fmt: skip

    def metric_average(val, name):
        tensor = torch.as_tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test():
        model.eval()
        test_loss = 0.0
        test_accuracy = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                if args.cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.data.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()
        # Horovod: use test_sampler to determine the number of examples in this worker's partition.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        # Horovod: average metric values across workers.
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n")

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())  # Horovod: pin GPU to local rank.
        torch.cuda.manual_seed(args.seed)
    elif args.use_mixed_precision:
        raise ValueError("Mixed precision is only supported with cuda enabled.")

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    train_dataset = digits(train=True)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )
    test_dataset = digits(train=False)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()
    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    scaler = torch.amp.GradScaler("cuda") if args.use_mixed_precision else None
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        if args.use_mixed_precision:
            train_mixed_precision(epoch, scaler)
        else:
            train_epoch(epoch)
        # Keep test in full precision since computation is relatively light.
        test()
    if hvd.rank() == 0:  # not in the original: for the throughput comparison with DDP
        samples = args.epochs * len(train_sampler) * hvd.size()
        print(f"Training time: {time.perf_counter() - start:.3f} s for {samples} samples")


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    main(args)
