"""The "multigpu torchrun" tutorial's Trainer, with snapshots, kept as written on loom's `DataParallel`.

``own_loop_torchrun.py SNAPSHOT_DIR TOTAL_EPOCHS OUT.safetensors``: PyTorch's ddp-tutorial-series
``multigpu_torchrun.py``. `ORIGINAL_LOOP` is its ``Trainer`` as published, on the CPU the way the tutorial runs it
with gloo (no ``.to(gpu_id)``, no ``map_location``); the ``port`` block is the ported ``Trainer``, which the test
diffs against it. Its snapshots go through `loom.checkpoint` (safetensors and JSON, no pickle) instead of
``torch.save``; the model is resumed from the snapshot as the tutorial does (``EPOCHS_RUN`` is the last epoch
run, so a resumed run repeats it, as the tutorial's does). Outside the Trainer: ``loom.init`` replaces
``ddp_setup``, ``job.loader`` the ``DistributedSampler`` loader (``batch_size`` is the global batch), and the
dataset is seeded (the tutorial's random data differs per process, which loom refuses) with 3 classes (its
1-class cross-entropy has a zero gradient). Rank 0 writes the final parameters to OUT.

Run by tests/test_own_loop.py (2 processes, then a resume at 3; the reference is one process).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

import loom
import loom.checkpoint

ORIGINAL_LOOP = """
class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)

        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
"""

job = None  # the loom job, built in main()


class MyTrainDataset(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size
        self.data = [(torch.rand(20), torch.randint(0, 3, ())) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return self.data[index]


# >>> port
# fmt: off
class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)

        self.model, self.optimizer, self.train_data = job.own_loop(self.train_data)

    def _load_snapshot(self, snapshot_path):
        snapshot = loom.checkpoint.load_checkpoint(snapshot_path)[1]
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        loom.checkpoint.save_checkpoint(self.snapshot_path, epoch, snapshot)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
# fmt: on
# <<< port


def main(snapshot_path: str, total_epochs: int, out: str | None = None) -> dict[str, torch.Tensor]:
    global job
    loom.init()
    torch.manual_seed(0)
    dataset = MyTrainDataset(50)
    model = torch.nn.Linear(20, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    job = loom.DataParallel().setup(model, optimizer)
    train_data = job.loader(dataset, global_batch_size=16, shuffle=True, seed=0)
    trainer = Trainer(model, train_data, optimizer, save_every=1, snapshot_path=snapshot_path)
    trainer.train(total_epochs)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if out is not None and loom.current().is_main:
        save_file(state, out)
    return state


if __name__ == "__main__":
    os.environ.setdefault("LOCAL_RANK", "0")
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    print(f"rank {loom.current().rank} done", flush=True)
