"""A tiny DataParallel job for the healing tests (``loom run --on-worker-failure heal``): writes, per process,
its pid, its start time and, per committed step, the time, the members and a hash of the parameters, and at the
end the final parameters, to ``HEAL_OUT/rank<r>.g<generation>.json``.

Run by tests/test_heal.py."""

import time

STARTED = time.time()

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import loom  # noqa: E402

STEPS = int(os.environ.get("HEAL_STEPS", "10"))
PAUSE_S = float(os.environ.get("HEAL_PAUSE_S", "0"))
"""Seconds each process rests after each step."""
WAIT_S = float(os.environ.get("HEAL_WAIT_S", "60"))
"""While a member is missing, each process waits (up to this) for its replacement to be ready before the next
step, so that the replacement joins however slowly the machine starts it (the tests check the joining)."""


WORLD = 1


def process_start_time() -> float:
    """When this process started (the kernel's count, so the interpreter's and torch's imports are included)."""
    with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
        ticks = int(stat.read().rpartition(")")[2].split()[19])
        now, since_boot = time.time(), float(uptime.read().split()[0])
    return now - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def model_and_data() -> tuple[nn.Module, torch.optim.Optimizer, torch.utils.data.TensorDataset]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    return model, optimizer, torch.utils.data.TensorDataset(x, y)


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def main() -> None:
    loom.init()
    initialized = time.time()
    global WORLD
    rank, gen = int(os.environ["RANK"]), int(os.environ.get("LOOM_HEAL_GENERATION", "0"))
    WORLD = int(os.environ["WORLD_SIZE"])
    model, optimizer, data = model_and_data()
    job = loom.DataParallel().setup(model, optimizer, nn.MSELoss())
    report = {"rank": rank, "generation": gen, "pid": os.getpid(), "started": process_start_time(), "script_started": STARTED,
              "initialized": initialized, "joined_at_step": job.step, "joined": time.time(), "steps": []}  # fmt: skip
    path = os.path.join(os.environ["HEAL_OUT"], f"rank{rank}.g{gen}.json")
    report["first_hash"] = digest(model)
    loader = job.loader(data, global_batch_size=12, seed=0)
    while job.step < STEPS:
        for batch in loader:
            loss = job.train_step(batch)
            report["steps"].append([job.step, time.time(), job.trained_by, digest(model), loss,
                                    int(batch.global_size)])  # fmt: skip
            with open(path, "w") as out:
                json.dump(report, out)
            if job.step >= STEPS:
                break
            time.sleep(PAUSE_S)
            deadline = time.monotonic() + WAIT_S
            while job.quorum.size < WORLD and not job.quorum.join_pending() and time.monotonic() < deadline:
                time.sleep(0.05)
    report["final"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    with open(path, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
