"""Nothing in the launcher grows with heals (issue 37, item 2): each replacement is a worker started by
`loom.launch.supervise.start_worker` (forked by the zygote) whose output is pumped until it ends, and the launcher
keeps each ended worker's record. Two pipe descriptors per heal leaked there (23 -> 109 over 43 heals). Here that
path runs 100 times (the issue's 200 took 7 minutes at load 10 on this 2-core host; 2 descriptors a time show at
any count), the launcher's descriptors, threads and memory counted before and after; `tests/test_heal.py` runs
real heals."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from loom.launch.supervise import start_worker, worker_env
from loom.launch.zygote import Forked, Zygote


def _counts() -> tuple[int, int, int]:
    """This process's open descriptors, threads and resident memory (KiB)."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return len(os.listdir("/proc/self/fd")), threading.active_count(), rss


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_hundred_replacements_leave_descriptors_threads_and_memory_flat(tmp_path, capfd):
    script = tmp_path / "quick.py"
    script.write_text("print('up')\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    args = ["-u", "-m", "loom.launch.worker", str(script)]
    env0 = worker_env(0, 1, 1, "leaks", logs / "zygote.error.json", "heal")
    env0["PYTHONPATH"] = os.pathsep.join(sys.path)
    os.environ["PYTHONPATH"] = env0["PYTHONPATH"]  # (worker_env copies this environment)
    zygote = Zygote(args, env0)
    zygote.start()
    kept = []  # the launcher keeps every worker's record (its verdict reads them)

    def replace(generation: int) -> None:
        worker = start_worker(0, 1, args, 1, "leaks", logs, "heal", generation, zygote=zygote)
        assert worker.proc.wait(timeout=60) == 0
        for reader in worker.readers:
            reader.join(timeout=30)
        kept.append(worker)

    try:
        for generation in range(1, 11):  # warm: the pump's first files, the reader thread's first start
            replace(generation)
        before = _counts()
        for generation in range(11, 111):
            replace(generation)
        after = _counts()
    finally:
        zygote.close()
    assert all(isinstance(w.proc, Forked) for w in kept), "the zygote did not fork them"
    assert after[0] <= before[0], f"descriptors {before[0]} -> {after[0]} over 100 replacements"
    assert after[1] <= before[1], f"threads {before[1]} -> {after[1]} over 100 replacements"
    assert after[2] - before[2] < 16 * 1024, f"resident memory {before[2]} -> {after[2]} KiB over 100"
    assert capfd.readouterr().out.count("[rank0]: up") == 110
