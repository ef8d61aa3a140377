"""Zygote for the crash-consistency test: pays for `import torch` once, then serves trials.

For each directory read from stdin it forks a child that resumes from that directory (as a restarted job
would) and saves checkpoints in a loop until the test SIGKILLs it; the zygote prints the child's pid, waits for
it and prints its wait status. A child that fails on its own exits with status 1 after printing the error.

Run by tests/test_checkpoint.py.
"""

import os
import sys
import traceback
import warnings

import torch

from loom.checkpoint import CorruptCheckpointWarning, load_checkpoint, save_checkpoint

torch.set_num_threads(1)


def save_until_killed(directory: str) -> None:
    warnings.simplefilter("error", CorruptCheckpointWarning)  # a damaged checkpoint must never be visible
    found = load_checkpoint(directory)
    step = found[0] if found is not None else 0
    while True:
        step += 1
        state = {
            "weights": torch.full((128, 1024), float(step)),  # 512 KiB, so that kills land inside writes
            "extra": {"step": step, "history": list(range(step % 7))},
        }
        save_checkpoint(directory, step, state, keep=2)


for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            save_until_killed(line.strip())
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(1)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(status, flush=True)
