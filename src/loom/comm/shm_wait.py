"""Waiting for a peer process through shared memory: spin briefly, then sleep in the kernel until woken.

1. **spin** (look again at once) for `SPIN_S`: when both processes run, the answer to a small message usually
   arrives within microseconds, and any sleep costs more;
2. **sleep on a futex** (Linux ``futex(FUTEX_WAIT)`` on the word the peer will write): the CPU goes to whoever
   needs it (often the very peer, when both share a core on a loaded machine), and the peer, having changed the
   word, sees the waiter's "asleep" flag and calls ``futex(FUTEX_WAKE)``. ``sched_yield`` or short ``sleep``
   calls were slower where the two processes shared a core: the yielder kept its core.

The kernel sleeps only while the word still holds the value the waiter last saw, so no change is lost between
the last look and the sleep; each sleep is bounded (`FUTEX_SLEEP_S`, shorter while this process has queued sends
to push). The whole wait is bounded: every `CHECK_EVERY_S` it checks the peer is alive (a dead peer raises at
once, naming it, its pid and the operation), and it gives up after `TIMEOUT_S`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loom.comm.shm_spin import SpinBudget

__all__ = ["SPIN_S", "TIMEOUT_S", "YIELD_S", "futex_wake", "give_way_to", "process_alive", "wait_until"]

SPIN_S = 20e-6
"""Seconds of busy looking before sleeping (module attribute: the micro-benchmark varies it); the least a
`loom.comm.shm_spin.SpinBudget` spins."""
YIELD_S = 0.0
"""Seconds of yielding the CPU (``sched_yield``) between spinning and sleeping (0: see the module docstring)."""
FUTEX_SLEEP_S = 0.01
"""Longest single sleep in the kernel (between two liveness checks, and in case a wake-up was missed)."""
BUSY_SLEEP_S = 5e-5
"""Longest single sleep while this process has queued sends to push."""
MAX_PAUSE_S = 5e-5
"""Longest sleep between two looks when there is no futex to sleep on."""
USE_FUTEX = True
"""False: never sleep on a futex, only ``time.sleep`` (benchmarks compare the two)."""
CHECK_EVERY_S = 0.1
TIMEOUT_S = 1800.0
"""As the backend's own timeout (`loom.init`): a peer doing its own work is waited for; the watchdog stops hangs,
and raises this past its own work timeout (`give_way_to`)."""


def give_way_to(seconds: float) -> None:
    """Wait at least ``seconds`` before giving up. The hang watchdog (`loom.fault.watchdog`) calls it with its work
    timeout and some slack, so that a peer stuck in its own code ends the job with the watchdog's report (the rank,
    its stack, the variable to change), not with this wait's bare error."""
    global TIMEOUT_S
    TIMEOUT_S = max(TIMEOUT_S, float(seconds))


_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64 (the only CPU shared memory is used on)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _syscall() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def futex_wait(addr: int, seen: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` (the low half of a little-endian int64) equals ``seen``'s low
    32 bits, at most ``timeout_s``; returns early when woken, or at once if the word differs already."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall().syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAIT),
        ctypes.c_long(seen & 0xFFFFFFFF), ctypes.byref(ts), ctypes.c_void_p(0), ctypes.c_long(0),
    )  # fmt: skip


def futex_wake(addr: int) -> None:
    """Wake every process sleeping in `futex_wait` on the word at ``addr``."""
    _syscall().syscall(
        ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAKE),
        ctypes.c_long(0x7FFFFFFF), ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_long(0),
    )  # fmt: skip


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
    futex: tuple[int, Callable[[], int], Callable[[int], None]] | None = None,
    busy: Callable[[], bool] | None = None,
    budget: SpinBudget | None = None,
) -> None:
    """Return once ``ready()`` is true; raise RuntimeError naming ``me``, ``peer`` and ``what`` (``"rank 3"``,
    ``"rank 2"``, ``"receive of ..."``) if ``peer`` (whose process id ``pid()`` reads, 0 while unknown) dies or
    `TIMEOUT_S` passes first.

    ``futex``: ``(address of the word the peer changes, a function reading it, a function setting this waiter's
    "asleep" flag)``; the peer calls `futex_wake` on that address after changing the word if the flag is set.
    ``busy()`` true: this process has queued sends, so it sleeps at most `BUSY_SLEEP_S` at a time.
    ``budget``: the waiter's `loom.comm.shm_spin.SpinBudget` (``spin()`` seconds of spinning, ``update(waited)``
    after the wait); None: spin `SPIN_S`."""
    clock = time.perf_counter
    start = clock()
    spin = budget.spin() if budget is not None else SPIN_S
    try:
        spin_until, yield_until = start + spin, start + spin + YIELD_S
        while True:  # spin, then yield the CPU between looks
            if progress is not None:
                progress()
            if ready():
                return
            now = clock()
            if now >= yield_until:
                break
            if now >= spin_until:
                os.sched_yield()
        pause, check_at = 1e-6, start + CHECK_EVERY_S
        while True:
            if progress is not None:
                progress()
            if futex is not None and USE_FUTEX:
                addr, word, asleep = futex
                seen = word()
                if ready():
                    return
                asleep(1)
                # looked again after raising the flag: the peer either sees it or changed the word
                if not ready():
                    futex_wait(addr, seen, BUSY_SLEEP_S if busy is not None and busy() else FUTEX_SLEEP_S)
                asleep(0)
            elif not ready():
                time.sleep(pause)
                pause = min(2 * pause, MAX_PAUSE_S)
            if ready():
                return
            now = clock()
            if now >= check_at:
                check_at = now + CHECK_EVERY_S
                _check(me, peer, pid(), what, check_pid, now - start)
    finally:
        if budget is not None:
            budget.update(clock() - start)


def _check(me: str, peer: str, peer_pid: int, what: str, check_pid: bool, waited: float) -> None:
    if check_pid and peer_pid and not process_alive(peer_pid):
        raise RuntimeError(
            f"{me}: {what}: {peer} (pid {peer_pid}) exited while {me} waited for it. "
            "HINT: its own log shows why it stopped."
        )
    if waited > TIMEOUT_S:
        raise RuntimeError(
            f"{me}: {what}: waited {waited:.0f} s for {peer} (pid {peer_pid}). HINT: {peer} may be stuck in its own "
            f"code (py-spy dump --pid {peer_pid} shows where), or the ranks did not send and receive the same "
            "messages in the same order; raise LOOM_WORK_TIMEOUT_S if its own work takes this long"
        )
