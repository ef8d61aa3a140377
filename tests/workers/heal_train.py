"""The healing tests' job (``loom run --on-worker-failure heal``): a tiny DataParallel, LocalSGD or DiLoCo job
that writes, per process, its pid, its start time and, per committed step, the time, the members that trained it
(for a round: the last committed round's), a hash of the parameters, the loss and the global batch's size, and at
the end the final parameters, to ``HEAL_OUT/rank<r>.g<generation>.json``.

Environment: ``HEAL_STRATEGY`` (``dp``, the default, ``localsgd`` or ``diloco``), ``HEAL_H`` (sync_every),
``HEAL_MOMENTUM`` (the SGD's momentum: 0.9 for dp, 0 for the rounds unless set), ``HEAL_STEPS``,
``HEAL_PAUSE_S`` (seconds each process rests after each step) and ``HEAL_SCRIPT_FAULT=RANK:STEP:KIND``: the first
process of rank RANK, after its step STEP, ``raise``s a ValueError (the script's own error: the job must stop) or
``leave``s as a worker the quorum told to leave (`loom.fault.quorum.LeftOutOfQuorum`: healed); ``stuck``: every
process of rank RANK, after a step >= STEP, hangs in `stuck_in_its_own_code` (a deterministic hang).
``HEAL_DP_OPTIONS``: a JSON object of DataParallel's options (e.g. ``{"accumulate": 3}``), ``HEAL_ROUND_OPTIONS``
LocalSGD's or DiLoCo's. ``HEAL_COUNT=1``: count
the collectives each step issues (`count_collectives`) into the report's ``collectives``; the script also runs
without ``--on-worker-failure heal``, for the same count on the job without healing. ``HEAL_COUNT_SAMPLES=1``: the
samples are served one ``__getitem__`` at a time (`CountedSamples`) and the report's ``fetched`` holds, per step,
the dataset indices this process fetched since the last step, one list per collation (a loader's fetch).

Run by tests/test_heal.py, test_heal_options.py, test_heal_rounds.py, test_heal_exit.py, test_heal_hosts.py and
test_heal_stuck.py."""

import time

STARTED = time.time()

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import loom  # noqa: E402
from loom.fault.quorum import LeftOutOfQuorum  # noqa: E402

STRATEGY = os.environ.get("HEAL_STRATEGY", "dp")
STEPS = int(os.environ.get("HEAL_STEPS", "10"))
H = int(os.environ.get("HEAL_H", "3")) if STRATEGY != "dp" else 1
PAUSE_S = float(os.environ.get("HEAL_PAUSE_S", "0"))
WAIT_S = float(os.environ.get("HEAL_WAIT_S", "60"))
"""While a member is missing, each process waits (up to this) before the next step (a round's first) for its
replacement to be ready, so that the replacement joins however slowly the machine starts it (the tests check the
joining; 0: never wait)."""


def process_start_time() -> float:
    """When this process started (the kernel's count, so the interpreter's and torch's imports are included)."""
    with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
        ticks = int(stat.read().rpartition(")")[2].split()[19])
        now, since_boot = time.time(), float(uptime.read().split()[0])
    return now - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def model_and_data(
    momentum: float = 0.9,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.utils.data.TensorDataset]:
    """The model, an SGD of lr 0.1 and this ``momentum``, and 64 samples."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    return model, optimizer, torch.utils.data.TensorDataset(x, y)


class CountedSamples(torch.utils.data.Dataset):
    """``data``'s samples, one ``__getitem__`` each, every index served logged; `collate` closes one fetch."""

    def __init__(self, data: torch.utils.data.Dataset) -> None:
        self.data, self.served, self.fetches = data, [], []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):  # noqa: ANN204
        self.served.append(index)
        return self.data[index]

    def collate(self, samples: list):  # noqa: ANN201
        self.fetches.append(self.served)
        self.served = []
        return torch.utils.data.default_collate(samples)

    def take(self) -> list[list[int]]:
        """The fetches since the last call."""
        fetches, self.fetches = self.fetches, []
        return fetches


def digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def stuck_in_its_own_code() -> None:
    time.sleep(600)


def script_fault(rank: int, gen: int, step: int) -> None:
    planned = os.environ.get("HEAL_SCRIPT_FAULT", "")
    if not planned:
        return
    want_rank, want_step, kind = planned.split(":")
    if kind == "stuck" and rank == int(want_rank) and step >= int(want_step):
        stuck_in_its_own_code()
    if gen:
        return
    if (int(want_rank), int(want_step)) != (rank, step):
        return
    if kind == "raise":
        raise ValueError(f"the script's own error on rank {rank} after step {step}")
    raise LeftOutOfQuorum(f"rank {rank}: told to leave after step {step} (HEAL_SCRIPT_FAULT)")


def count_collectives() -> list[int]:
    """A one-element counter of the collectives this process issues from here on: every call of a process
    group's collective methods (what `torch.distributed`'s functions and loom's gloo calls end in) and every
    shared-memory gradient exchange (`loom.comm.shared_gradients`, one collective that runs no process group)."""
    import torch.distributed as dist

    from loom.comm.shared_gradients import SharedGradients

    count = [0]

    def counted(method):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            count[0] += 1
            return method(*args, **kwargs)

        return call

    for name in ("allreduce", "allreduce_coalesced", "allgather", "allgather_into_tensor_coalesced",
                 "_allgather_base", "broadcast", "reduce_scatter", "_reduce_scatter_base", "alltoall",
                 "alltoall_base", "barrier", "send", "recv", "reduce", "gather", "scatter"):  # fmt: skip
        if hasattr(dist.ProcessGroup, name):
            setattr(dist.ProcessGroup, name, counted(getattr(dist.ProcessGroup, name)))
    SharedGradients.average = counted(SharedGradients.average)  # type: ignore[method-assign]
    return count


def strategy():  # noqa: ANN201 (a loom strategy)
    if STRATEGY == "dp":
        return loom.DataParallel(**json.loads(os.environ.get("HEAL_DP_OPTIONS", "{}")))
    options = json.loads(os.environ.get("HEAL_ROUND_OPTIONS", "{}"))
    return (
        loom.DiLoCo(sync_every=H, **options)
        if STRATEGY == "diloco"
        else loom.LocalSGD(sync_every=H, **options)
    )


def main() -> None:
    loom.init()
    initialized = time.time()
    rank, gen = int(os.environ["RANK"]), int(os.environ.get("LOOM_HEAL_GENERATION", "0"))
    world = int(os.environ["WORLD_SIZE"])
    momentum = float(os.environ.get("HEAL_MOMENTUM", "0.9" if STRATEGY == "dp" else "0"))
    model, optimizer, data = model_and_data(momentum)
    counter = count_collectives() if os.environ.get("HEAL_COUNT") else None
    job = strategy().setup(model, optimizer, nn.MSELoss())
    report = {"rank": rank, "generation": gen, "pid": os.getpid(), "started": process_start_time(),
              "script_started": STARTED, "initialized": initialized, "joined_at_step": job.step,
              "joined": time.time(), "steps": [], "first_hash": digest(model), "collectives": []}  # fmt: skip
    path = os.path.join(os.environ["HEAL_OUT"], f"rank{rank}.g{gen}.json")
    counted = CountedSamples(data) if os.environ.get("HEAL_COUNT_SAMPLES") else None
    if counted is not None:
        report["fetched"] = []
        loader = job.loader(counted, global_batch_size=12, seed=0, collate_fn=counted.collate)
    else:
        loader = job.loader(data, global_batch_size=12, seed=0)
    while job.step < STEPS:
        for batch in loader:
            before = counter[0] if counter is not None else 0
            loss = job.train_step(batch)
            if counter is not None:
                report["collectives"].append(counter[0] - before)
            if counted is not None:
                report["fetched"].append(counted.take())
            report["steps"].append([job.step, time.time(), job.trained_by, digest(model), loss,
                                    int(batch.global_size)])  # fmt: skip
            with open(path, "w") as out:
                json.dump(report, out)
            if job.step >= STEPS:
                break
            script_fault(rank, gen, job.step)
            time.sleep(PAUSE_S)
            deadline = time.monotonic() + WAIT_S
            while (getattr(job, "quorum", None) is not None and job.step % H == 0 and job.quorum.size < world
                   and not job.quorum.join_pending()
                   and time.monotonic() < deadline):  # fmt: skip
                time.sleep(0.05)
    report["final"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    with open(path, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
