"""The zygote's side of `loom.launch.zygote` (``python -m loom.launch.zygote_process``): import what every worker
imports (`WARM`), say so, then fork one worker per request of the launcher and report each one's exit status.
A forked worker becomes the worker (`_become`): its environment, arguments, standard streams, command line and
``/proc`` environment, its death with the zygote; and it ends as an interpreter does (`finish`). The frames are
`loom.launch.zygote_wire`'s."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from loom.launch.worker import exit_code, finish
from loom.launch.zygote_wire import read_request, reply
from loom.settings import setting

__all__ = ["PER_RANK", "ROOM", "STARTUP_PREFIXES", "WARM", "exit_code", "finish", "main", "reaped", "retitle"]

WARM = ("torch", "torch.distributed", "numpy.random", "loom.parallel", "loom.train.fit", "loom.launch.worker",
        "torch._dynamo", "torch.nn.parallel", "torch.distributed.elastic.multiprocessing.errors")  # fmt: skip
"""What the zygote imports: what every worker imports first, and what its first optimizer and step import."""
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "NPY_", "TORCH_", "TORCHDYNAMO",
                    "TORCHINDUCTOR", "LD_", "MALLOC_", "CUDA")  # fmt: skip
"""Variables read when the interpreter, torch or OpenMP start: a worker whose values differ from the zygote's is
a fresh interpreter."""
PER_RANK = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "LOOM_HEAL_GENERATION",
    "TORCHELASTIC_ERROR_FILE",
)
"""Variables that differ per worker: the zygote starts without them, so that no worker's ``/proc/PID/environ``
(the block the zygote was started with, unless `_show_environ` rewrites it) names another rank's."""
_FD_ENV = "LOOM_ZYGOTE_FD"
_ROOM_ENV = "LOOM_ZYGOTE_ROOM"
ROOM = 4096
"""Bytes of command line the zygote is started with (a placeholder argument), which each forked worker rewrites
to its own command (`retitle`), so that ``ps``, ``pgrep -f`` and ``pkill -f train.py`` find it by its script."""


def retitle(argv: list[str]) -> None:
    """Show ``argv`` as this process's command line (``/proc/self/cmdline``), cut to the room the process started
    with: the kernel reads it from the memory between ``arg_start`` and ``arg_end`` (``/proc/self/stat``), where
    the interpreter's own copy of its arguments no longer is (``sys.argv`` is separate), as ``setproctitle`` does.
    Linux only; elsewhere, or if anything fails, the command line stays as it was."""
    _rewrite(45, [a.encode() for a in argv], cut=True)


def _show_environ(env: dict[str, str]) -> None:
    """Show ``env`` as this process's ``/proc/self/environ`` (the block between ``env_start`` and ``env_end``,
    which the kernel reads and which still holds the zygote's own start environment): the per-rank variables
    first, then whole variables while they fit (`ROOM` spare bytes were reserved at the zygote's start); one that
    does not fit is left out, never cut. Call it once ``os.environ`` no longer points into that block."""
    first = [k for k in PER_RANK if k in env] + [k for k in env if k not in PER_RANK]
    _rewrite(47, [f"{k}={env[k]}".encode() for k in first], cut=False)


def _rewrite(field: int, items: list[bytes], cut: bool) -> None:
    """Write NUL-separated ``items`` over the memory that field ``field`` and the next of ``/proc/self/stat``
    bound (counted after the command name: 45 is ``arg_start``, 47 ``env_start``), zero-filled."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        start, end = int(fields[field]), int(fields[field + 1])
        room = max(0, end - start - 1)
        text = b""
        for item in items:
            joined = text + (b"\0" if text else b"") + item
            if len(joined) > room:
                if cut:
                    text = joined[:room]
                break
            text = joined
        ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)
    except (OSError, ValueError, IndexError):
        return


def _become(request: dict[str, Any], fds: list[int], sock: socket.socket, zygote: int) -> None:
    """In the forked child: become the worker, run it, end as the interpreter would; never returns."""
    code = 1
    try:
        from loom.launch.worker import die_with_parent

        die_with_parent()  # (the zygote, which dies with the launcher)
        if os.getppid() != zygote:  # it died before the kernel was told: its launcher counts this rank lost
            os._exit(1)
        if request.get("session"):
            os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
        sock.close()
        for target, fd in enumerate(fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        _show_environ(request["env"])  # (os.environ's C copy no longer points into the block it rewrites)
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) > 0:  # OpenMP read the zygote's value at load
            import torch

            torch.set_num_threads(int(threads))
        if "numpy.random" in sys.modules:  # a fresh interpreter seeds its own; a fork shares the zygote's
            sys.modules["numpy.random"].seed()
        sys.argv = ["loom.launch.worker", *request["argv"]]
        title = request.get("title")
        if isinstance(title, list) and all(isinstance(a, str) for a in title):
            retitle(title)
        from loom.launch import worker

        worker.main()
        code = 0
    except SystemExit as stop:
        code = exit_code(stop.code)
    except BaseException as error:  # as the interpreter reports an uncaught exception
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    finally:
        finish(code)


def end_strays(forked: set[int]) -> None:
    """SIGKILL every forked worker not reaped yet, and its session: the launcher ended the zygote, so it counts
    every worker as ended. A backstop to PDEATHSIG: nothing of a job may outlive its launcher."""
    for pid in sorted(forked):
        with contextlib.suppress(OSError):
            # a worker in a session of its own leads its group: what it started too
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if forked:
        print(f"loom run: the zygote ended {len(forked)} worker(s) still running after the job: "
              f"{sorted(forked)}", file=sys.stderr, flush=True)  # fmt: skip


def reaped() -> Iterator[tuple[int, int]]:
    """Each child of this process that has ended since the last call, reaped: its pid and its exit status as
    `subprocess.Popen.returncode` says it (-N for signal N); never blocks."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def main() -> None:
    import importlib
    import select

    from loom.launch.worker import die_with_parent

    die_with_parent()
    retitle([sys.executable, "-m", "loom.launch.zygote_process"])  # (its placeholder is the workers' room)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle (it stops the workers)
    sock = socket.socket(fileno=int(os.environ.pop(_FD_ENV)))
    os.environ.pop(_ROOM_ENV, None)
    time.sleep(setting("LOOM_TEST_ZYGOTE_DELAY_S"))  # a test hook (a slow host); 0 when unset
    for name in WARM:
        importlib.import_module(name)
    alone = threading.active_count() == 1  # a fork copies one thread: only fork a process that has one
    reply(sock, {"ready": True})  # the launcher sends no request before this line
    forked: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.01)
        for ended, code in reaped():
            forked.discard(ended)
            reply(sock, {"exited": ended, "status": code})
        if not readable:
            continue
        got = read_request(sock)
        if got is None:  # the launcher is done: its workers have ended
            end_strays(forked)
            finish(0)  # without freeing torch object by object: ~0.7 s of CPU the launcher would wait for
        request, fds = got
        pid = None
        if alone:
            sys.stdout.flush()
            sys.stderr.flush()
            zygote = os.getpid()
            pid = os.fork()
            if pid == 0:
                _become(request, fds, sock, zygote)
            forked.add(pid)
        for fd in fds:
            os.close(fd)
        reply(sock, {"id": request.get("id"), "pid": pid})


if __name__ == "__main__":
    main()
