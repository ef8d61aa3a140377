"""Waiting for a peer process through shared memory: spin briefly, then yield, then sleep; bounded, never blind.

A process waiting for a word of shared memory that its peer will write has three ways to wait, each right for a
different delay:

1. **spin** (look again at once) for `SPIN_S`: the answer to a small message usually arrives within a few
   microseconds when both processes run, and any sleep costs far more (a Linux sleep lasts at least the
   thread's timer slack, 50 us by default);
2. **yield** (``sched_yield``) for `YIELD_S`: when the two processes share a core, or other jobs load the
   machine, the spinner hands its core to whoever is runnable, which may be the very peer it waits for;
3. **sleep** in pauses growing to `MAX_PAUSE_S`: a peer busy with its own work (a long forward) is waited for
   without burning a core that two processes on a 2-core machine need.

The wait is bounded: every `CHECK_EVERY_S` it checks that the peer process is alive (a dead peer raises at once,
naming its rank, its pid and the operation), and after `TIMEOUT_S` it gives up (as the backend's own timeout;
`loom.train.guard.StepGuard.collective` and the hang watchdog stop hangs long before). ``progress`` is called
while waiting, so that a process blocked in one receive keeps pushing its queued sends (two stages that both
wait for each other's data never deadlock on a full ring).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["SPIN_S", "TIMEOUT_S", "YIELD_S", "process_alive", "wait_until"]

SPIN_S = 30e-6
"""Seconds of busy looking before the first yield (module attribute: `loom_bench.model_parallel` varies it)."""
YIELD_S = 300e-6
"""Seconds of yielding the CPU (``sched_yield``) before the first sleep."""
MAX_PAUSE_S = 5e-5
"""Longest sleep between two looks."""
CHECK_EVERY_S = 0.1
TIMEOUT_S = 1800.0
"""As the backend's own timeout (`loom.init`): a peer doing its own work is waited for; the watchdog stops hangs."""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (dead, not yet reaped by its parent) does not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def wait_until(
    ready: Callable[[], bool],
    *,
    me: str,
    peer: str,
    pid: Callable[[], int],
    what: str,
    progress: Callable[[], object] | None = None,
    check_pid: bool = True,
) -> None:
    """Return once ``ready()`` is true; raise RuntimeError naming ``me``, ``peer`` and ``what`` (``"rank 3"``,
    ``"rank 2"``, ``"receive of ..."``) if ``peer`` (whose process id ``pid()`` reads, 0 while unknown) dies or
    `TIMEOUT_S` passes first."""
    clock = time.perf_counter
    start = clock()
    until = start + SPIN_S
    while True:
        if progress is not None:
            progress()
        if ready():
            return
        if clock() >= until:
            break
    until = start + SPIN_S + YIELD_S
    while clock() < until:
        os.sched_yield()
        if progress is not None:
            progress()
        if ready():
            return
    pause, check_at = 1e-6, start + CHECK_EVERY_S
    while True:
        if progress is not None:
            progress()
        if ready():
            return
        time.sleep(pause)
        pause = min(2 * pause, MAX_PAUSE_S)
        now = clock()
        if now < check_at:
            continue
        check_at = now + CHECK_EVERY_S
        peer_pid = pid()
        if check_pid and peer_pid and not process_alive(peer_pid):
            raise RuntimeError(
                f"{me}: {what}: {peer} (pid {peer_pid}) exited while {me} waited for it. "
                "HINT: its own log shows why it stopped."
            )
        if now - start > TIMEOUT_S:
            raise RuntimeError(
                f"{me}: {what}: waited {now - start:.0f} s for {peer} (pid {peer_pid}). "
                "HINT: every rank must send and receive the same messages in the same order."
            )
