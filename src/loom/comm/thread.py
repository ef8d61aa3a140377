"""`CommThread`: one daemon thread that runs a process group's collectives in the order they were submitted.

Collectives are matched across ranks by call order (gloo by sequence number, shm by its barrier counters), so
off the training thread they must run one after another, in the order every rank submits them: one FIFO thread
per group: the process's shared `comm_thread()` for DDP's overlapped hook (`loom.comm.ddp_async`), and a thread
of its own for DiLoCo's outer exchange (`loom.parallel.replica.diloco`).

A daemon, unlike `concurrent.futures.ThreadPoolExecutor`'s threads: when a peer has died and the training thread
raises, a collective left waiting here must not keep the process alive at exit. Every call's outcome reaches its
future, exceptions included (an unsettled future would leave its waiter blocked forever).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

__all__ = ["CommThread", "comm_thread", "shutdown_comm_thread", "torch_future"]

_STOP = object()


class CommThread:
    """One daemon thread running submitted calls in FIFO order; each call's result or exception goes into the
    `concurrent.futures.Future` that `submit` returns."""

    def __init__(self, name: str = "loom-comm") -> None:
        self.name = name
        self.pid = os.getpid()
        """The process that started the thread (a forked child inherits the object, not the thread)."""
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` after the calls submitted before; its result or exception comes in the future.
        Raises RuntimeError when the thread has stopped (nothing would ever run the call)."""
        if not self._thread.is_alive():
            raise RuntimeError(f"the communication thread {self.name!r} has stopped (interpreter exiting?)")
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (call := self._calls.get()) is not _STOP:
            future, fn, args = call
            try:
                result = fn(*args)
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the result, never lost
                future.set_exception(error)
            else:
                future.set_result(result)

    def stop(self, timeout: float | None = None) -> None:
        """Finish the calls submitted so far, then end the thread (waiting at most ``timeout`` seconds; None:
        until it ends)."""
        if self._thread.is_alive():
            self._calls.put(_STOP)
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()


def torch_future(future: Future, describe: Callable[[], str]) -> torch.futures.Future[torch.Tensor]:
    """A ``torch.futures.Future`` settled with ``future``'s outcome (what DDP's communication hooks return); an
    exception arrives as a RuntimeError starting with ``describe()``: ``"<describe()> failed: <error>"``."""
    settled: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def settle(done: Future) -> None:
        error = done.exception()
        if error is not None:
            failure = RuntimeError(f"{describe()} failed: {error!r}")
            settled.set_exception(failure)  # type: ignore[arg-type]  # torch annotates the argument as T
        else:
            settled.set_result(done.result())

    future.add_done_callback(settle)
    return settled


_THREAD: CommThread | None = None
_THREAD_LOCK = threading.Lock()


def comm_thread() -> CommThread:
    """This process's shared communication thread, started on first use (and again in a forked child, which
    does not inherit threads); starting it registers `shutdown_comm_thread` at exit, once (not at import:
    STYLE rule 18)."""
    global _THREAD
    with _THREAD_LOCK:
        if _THREAD is None or _THREAD.pid != os.getpid() or not _THREAD.is_alive():
            _THREAD = CommThread()
            atexit.unregister(shutdown_comm_thread)
            atexit.register(shutdown_comm_thread)
        return _THREAD


def shutdown_comm_thread() -> None:
    """Stop this process's shared communication thread after its queued calls (waiting at most 5 s); called at
    interpreter exit once the thread has started."""
    global _THREAD
    with _THREAD_LOCK:
        thread, _THREAD = _THREAD, None
    if thread is not None and thread.pid == os.getpid():
        thread.stop(timeout=5.0)
