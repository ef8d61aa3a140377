"""heal_train.py's job (same model, data and report), run across hosts too, with errors of the script's own.

``HEAL_SCRIPT_FAULT=RANK:STEP:KIND``: the first process of rank RANK, after its step STEP, ``raise``s a
ValueError (the script's own error: the job must stop) or ``leave``s as a worker the quorum told to leave
(`loom.fault.quorum.LeftOutOfQuorum`: healed). Per process it writes ``HEAL_OUT/rank<r>.g<generation>.json`` as
heal_train.py does (tests/test_heal.py's checks read it).

Run by tests/test_heal_exit.py and tests/test_heal_hosts.py."""

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402

from heal_train import digest, model_and_data, process_start_time  # noqa: E402
from torch import nn  # noqa: E402

import loom  # noqa: E402
from loom.fault.quorum import LeftOutOfQuorum  # noqa: E402

STEPS = int(os.environ.get("HEAL_STEPS", "10"))
PAUSE_S = float(os.environ.get("HEAL_PAUSE_S", "0"))
WAIT_S = float(os.environ.get("HEAL_WAIT_S", "60"))
"""While a member is missing, wait (up to this) for its replacement before the next step (0: never wait)."""


def script_fault(rank: int, gen: int, step: int) -> None:
    planned = os.environ.get("HEAL_SCRIPT_FAULT", "")
    if not planned or gen:
        return
    want_rank, want_step, kind = planned.split(":")
    if (int(want_rank), int(want_step)) != (rank, step):
        return
    if kind == "raise":
        raise ValueError(f"the script's own error on rank {rank} after step {step}")
    raise LeftOutOfQuorum(f"rank {rank}: told to leave after step {step} (HEAL_SCRIPT_FAULT)")


def main() -> None:
    loom.init()
    initialized = time.time()
    rank, gen = int(os.environ["RANK"]), int(os.environ.get("LOOM_HEAL_GENERATION", "0"))
    world = int(os.environ["WORLD_SIZE"])
    model, optimizer, data = model_and_data()
    job = loom.DataParallel().setup(model, optimizer, nn.MSELoss())
    report = {"rank": rank, "generation": gen, "pid": os.getpid(), "started": process_start_time(),
              "script_started": STARTED, "initialized": initialized, "joined_at_step": job.step,
              "joined": time.time(), "steps": [], "first_hash": digest(model)}  # fmt: skip
    path = os.path.join(os.environ["HEAL_OUT"], f"rank{rank}.g{gen}.json")
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
            script_fault(rank, gen, job.step)
            time.sleep(PAUSE_S)
            deadline = time.monotonic() + WAIT_S
            while job.quorum.size < world and not job.quorum.join_pending() and time.monotonic() < deadline:
                time.sleep(0.05)
    report["final"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    with open(path, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
