"""Entry point of every worker process `loom run` starts: ``python -m loom.launch.worker [-m] TARGET ARGS``.

Runs the user's script as ``__main__``; an exception it raises is recorded in its error file (torchrun's format),
so the launcher can name the failing rank and its error. A `loom.errors.StartRefused` (the job refuses the
launcher's settings) and a `loom.errors.LeftOutOfQuorum` (the healing quorum told this worker to leave) are
printed as one line; the latter ends the process with its ``exit_status`` (75), "replace me" to the launcher
(`loom.launch.heal`). The kernel kills the worker if the launcher dies, even by SIGKILL, so no worker outlives its
job. The script's own ``init_process_group()`` is routed to the job's store first (`loom.launch.script_init`),
so a script written for torchrun runs unported.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to kill this process when its parent (the launcher) dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)


def run_target(argv: list[str]) -> None:
    """Run ``[-m MODULE | SCRIPT] ARGS`` as ``__main__``, as ``python`` would."""
    if not argv:
        raise SystemExit("usage: python -m loom.launch.worker [-m MODULE | SCRIPT] [ARGS...]")
    if argv[0] == "-m":
        sys.argv = argv[1:]  # [MODULE, *ARGS]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def _atomic_error_handler():
    """torch's error-file writer, writing the file whole or not at all: torch's opens the file (emptying it) and
    then writes, so a worker stopped meanwhile (the launcher's SIGTERM to the group, while it records its own
    exception) left an empty file, and the launcher lost the exception that named the root failure."""
    import json
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class AtomicErrorHandler(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            path = self._get_error_file_path()
            if not path:
                return super().record_exception(e)  # torch logs it
            data = {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": {
                "py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}  # fmt: skip
            fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".error-")
            with os.fdopen(fd, "w") as out:
                json.dump(data, out)
            os.replace(temporary, path)

    return AtomicErrorHandler()


def finish(code: int) -> NoReturn:
    """End a forked process as ``Py_FinalizeEx`` would, as far as a program can observe: non-daemon threads
    joined, ``atexit`` run, every open file flushed; then ``os._exit``, without freeing each object one by one
    (costly with torch loaded; loom cleans up in ``atexit``, not in ``__del__``)."""
    import atexit
    import gc
    import io

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        writers = {io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom}  # type(), not isinstance: no hook
        for stream in [sys.stdout, sys.stderr, *(o for o in gc.get_objects() if type(o) in writers)]:
            with contextlib.suppress(Exception):
                if not stream.closed:
                    stream.flush()
    finally:
        os._exit(code & 0xFF)


def exit_code(code: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into a status: None 0, an int itself, else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    from loom.errors import LeftOutOfQuorum, StartRefused
    from loom.launch.script_init import install

    die_with_parent()
    install()  # the script's own init_process_group() joins loom's store (no-op outside `loom run`)
    try:
        # records an exception for the launcher, raises it
        record(run_target, _atomic_error_handler())(sys.argv[1:])
    except (LeftOutOfQuorum, StartRefused) as error:
        # Told to leave (healing), or a refusal at start-up (the same on every rank): ended on purpose, not a
        # bug: one line, no traceback, and no exit barrier with peers that refuse too.
        print(f"loom: rank {os.environ.get('RANK', '?')}: {error}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(error.exit_status if isinstance(error, LeftOutOfQuorum) else 1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:
        finish(exit_code(stop.code))
    finish(0)  # as a forked worker ends: no destructors (a script's kept process groups: `script_init._kept`)
