"""A tiny LocalSGD or DiLoCo job for the healing tests of sync rounds (``loom run --on-worker-failure heal``):
writes, per process, its pid, the step it joined at and a hash of its parameters then, per step the
time, the members that trained the last committed round, a hash of the parameters and the loss, and at the end
the final parameters, to ``HEAL_OUT/rank<r>.g<generation>.json``.

``HEAL_STRATEGY``: ``localsgd`` or ``diloco``; ``HEAL_H``: sync_every; ``HEAL_MOMENTUM``: the inner SGD's
momentum. Run by tests/test_heal_rounds.py."""

import json
import os
import time

import heal_train  # this folder is the script's, so on its path
import torch
from heal_train import digest
from torch import nn

import loom

STEPS = int(os.environ.get("HEAL_STEPS", "12"))
H = int(os.environ.get("HEAL_H", "3"))
WAIT_S = float(os.environ.get("HEAL_WAIT_S", "60"))
"""While a member is missing, each process waits (up to this) at each round boundary for its replacement to be
ready, so that the replacement joins however slowly the machine starts it (the tests check the joining)."""


def model_and_data(
    momentum: float = 0.0,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.utils.data.TensorDataset]:
    """heal_train.py's model and data, with an SGD of lr 0.1 and this ``momentum``."""
    model, _sgd, data = heal_train.model_and_data()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), data


def main() -> None:
    loom.init()
    rank, gen = int(os.environ["RANK"]), int(os.environ.get("LOOM_HEAL_GENERATION", "0"))
    world = int(os.environ["WORLD_SIZE"])
    model, optimizer, data = model_and_data(float(os.environ.get("HEAL_MOMENTUM", "0")))
    strategy = (
        loom.DiLoCo(sync_every=H) if os.environ["HEAL_STRATEGY"] == "diloco" else loom.LocalSGD(sync_every=H)
    )
    job = strategy.setup(model, optimizer, nn.MSELoss())
    report = {"rank": rank, "generation": gen, "pid": os.getpid(), "joined_at_step": job.step,
              "first_hash": digest(model), "steps": []}  # fmt: skip
    path = os.path.join(os.environ["HEAL_OUT"], f"rank{rank}.g{gen}.json")
    loader = job.loader(data, global_batch_size=12, seed=0)
    while job.step < STEPS:
        for batch in loader:
            loss = job.train_step(batch)
            report["steps"].append([job.step, time.time(), job.trained_by, digest(model), loss])
            with open(path, "w") as out:
                json.dump(report, out)
            if job.step >= STEPS:
                break
            deadline = time.monotonic() + WAIT_S
            while (job.step % H == 0 and job.quorum.size < world and not job.quorum.join_pending()
                   and time.monotonic() < deadline):  # fmt: skip
                time.sleep(0.05)
    report["final"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    with open(path, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
