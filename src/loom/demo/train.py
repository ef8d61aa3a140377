"""Train a small CNN on scikit-learn's 8x8 handwritten digits (bundled with the package: no download).

Runs unchanged as one process (``python -m loom.demo.train``) or many (``loom run -n 2 -m loom.demo.train``).
Rank 0 shows progress and per-epoch loss/accuracy (already reduced across workers) and can write a summary JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import loom
from loom.observe.progress import ProgressBar


def digits_datasets(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train/test split of the 1,797 digits, images scaled to [0, 1], fixed by ``seed``."""
    try:  # scikit-learn is an optional extra: it only supplies the demo's bundled data
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            f"the demo trains on scikit-learn's bundled digits, and scikit-learn is not installed ({error}). "
            "HINT: pip install 'loom-train[demo]'"
        ) from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def digits_cnn(width: int = 1) -> nn.Module:
    """Two convolutions and two linear layers; ``width`` multiplies every layer's channels (the demo uses 2,
    so that a step's compute outweighs its gradient all-reduce and two workers beat one process)."""
    torch.manual_seed(0)  # same initial weights in every process (DataParallel also broadcasts rank 0's)
    c1, c2, hidden = 16 * width, 32 * width, 64 * width
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * 4 * 4, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(dim=1) == targets).float().mean()


def evaluate(job, test_loader) -> tuple[float, float]:
    """Test loss and accuracy over the whole test set (each global batch weighted by its size)."""
    total = loss = correct = 0.0
    for batch in test_loader:
        result = job.eval_step(batch, metrics={"accuracy": accuracy})
        total += batch.global_size
        loss += result["loss"] * batch.global_size
        correct += result["accuracy"] * batch.global_size
    return loss / total, correct / total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--width", type=int, default=2, help="channel multiplier of the CNN")
    parser.add_argument("--summary", type=Path, default=None, help="write the final figures here (rank 0)")
    args = parser.parse_args(argv)

    topo = loom.init()
    train_set, test_set = digits_datasets()
    model = digits_cnn(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    job = loom.DataParallel().setup(model, optimizer, nn.functional.cross_entropy)
    train_loader = job.loader(train_set, args.global_batch, seed=0)
    test_loader = job.loader(test_set, 512, shuffle=False)

    if topo.is_main:
        print(
            f"training a CNN on {len(train_set)} digits with {topo.world_size} worker(s), "
            f"global batch {args.global_batch}, {args.epochs} epochs",
            flush=True,
        )
    train_time, trained = 0.0, 0
    result: dict = {}
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        losses = []
        title = f"epoch {epoch + 1}/{args.epochs}"
        with ProgressBar(len(train_loader), title, enabled=topo.is_main, metrics=job.metrics) as bar:
            started = time.perf_counter()
            for batch in train_loader:
                losses.append(job.train_step(batch))
                trained += batch.global_size
                bar.advance()
            train_time += time.perf_counter() - started
        test_loss, test_acc = evaluate(job, test_loader)
        result = {
            "workers": topo.world_size,
            "epochs": epoch + 1,
            "train_loss": sum(losses) / len(losses),
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "samples_per_s": trained / train_time,
        }
        if topo.is_main:
            print(
                f"epoch {epoch + 1}: train loss {result['train_loss']:.4f}  test loss {test_loss:.4f}  "
                f"test accuracy {100 * test_acc:.2f}%  {result['samples_per_s']:.0f} samples/s",
                flush=True,
            )
    if topo.is_main and args.summary is not None:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(result, indent=2))
    job.metrics.close()
    return result


if __name__ == "__main__":
    main()
