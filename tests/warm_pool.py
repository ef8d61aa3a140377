"""A forked warm worker pool: rank processes that start with torch and loom already imported.

Every rank of a multi-process test used to be a fresh interpreter: `import loom` (torch with it) costs about 2 s
of CPU before the rank does anything, and its first optimizer about 1.4 s more (torch.optim imports
torch._dynamo, and sympy with it), so a test that starts four ranks three times spent some 40 CPU-seconds
importing. Here one *zygote* process imports them once (`WARM_MODULES`), and each rank is a ``fork()`` of it that
runs the worker script as ``__main__`` (``runpy``), as ``python script.py args`` would:

- its own session (``setsid``, so ``os.killpg(pid, SIGKILL)`` ends it and whatever it started), its working
  directory, its environment (``os.environ`` replaced, so C-level ``getenv`` sees it too), ``sys.argv`` and
  ``sys.path[0]`` (the script's folder), stdin from /dev/null, stdout and stderr into the given files;
- the normal end of an interpreter (non-daemon threads joined, ``atexit``, buffers flushed); an uncaught
  exception prints its traceback and exits 1, a signal ends it with ``-signum`` as ``Popen.returncode`` says;
- ``random`` is reseeded in the child by Python itself (``os.register_at_fork``); numpy's global generator, if
  the zygote imported it, is reseeded here.

What a fork cannot give is what was decided at interpreter start: ``PYTHON*`` variables, hash randomization
(every rank of a pool shares the zygote's ``PYTHONHASHSEED``; a fresh interpreter draws its own) and what torch
and OpenMP read when they load (``OMP_NUM_THREADS``, ...). `WarmPool` therefore keeps one zygote per value of
those variables (`STARTUP_PREFIXES`), started with them; past `WarmPool.MAX_ZYGOTES` a rank is a fresh
interpreter (`subprocess.Popen`), as before. ``LOOM_WARM_POOL=0`` turns the pool off altogether.
Only loom's own import is shared: no test state, no process group, no thread of the test process (the zygote is
its own process, started from a clean interpreter, not a fork of pytest).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from loom.launch import zygote_process as launcher_zygote

STARTUP_PREFIXES = (*launcher_zygote.STARTUP_PREFIXES, "HOROVOD_")
"""Variables read when the interpreter, torch or OpenMP start (the launcher's zygote's list, and loom's Horovod
shim's, read when it loads): a child whose value differs gets a fresh process (OMP_NUM_THREADS included: unlike
the launcher's zygote, a rank here does not set torch's threads from it)."""

WARM_MODULES = (
    "torch", "torch.distributed", "loom", "numpy.random",
    # `import loom` imports its names on first use: what the names bring, imported here once
    "loom.parallel", "loom.train.fit", "loom.checkpoint", "loom.comm", "loom.data", "loom.observe.trackers",
    # imported by every rank that builds an optimizer (torch.optim's `_compile` hook imports dynamo, and sympy with
    # it: about 1.4 s of CPU) or wraps DDP; a fresh rank imports them too, later
    "torch._dynamo", "torch.nn.parallel", "torch.distributed.algorithms.ddp_comm_hooks", "torch.distributed.nn",
)  # fmt: skip
"""What the zygote imports once: torch and loom, and what a rank imports on its first step anyway."""


def _startup_view(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


class WarmChild:
    """The part of `subprocess.Popen` the rank harnesses use (``pid``, ``poll``, ``wait``, ``returncode``) for a
    child of the zygote, whose exit status the zygote reports."""

    def __init__(self, pool: _Zygote, pid: int) -> None:
        self._pool, self.pid, self.returncode = pool, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._pool._code(self.pid, block=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._pool._code(self.pid, block=True, timeout=timeout)
        assert self.returncode is not None
        return self.returncode


class WarmPool:
    """The session's zygotes, one per startup environment (`STARTUP_PREFIXES`: a test whose ranks get, say,
    ``PYTHONUNBUFFERED=1`` or another ``OMP_NUM_THREADS`` gets a zygote started with it, at most `MAX_ZYGOTES`);
    each is started at its first spawn. `spawn` forks a rank from the zygote of the rank's environment."""

    MAX_ZYGOTES = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zygotes: dict[tuple, _Zygote] = {}

    def usable(self, env: dict[str, str]) -> bool:
        return os.environ.get("LOOM_WARM_POOL", "1") != "0"

    def zygote_for(self, env: dict[str, str]) -> _Zygote | None:
        """The zygote whose startup environment is ``env``'s (made, not started, if new); None past the cap."""
        key = tuple(sorted(_startup_view(env).items()))
        with self._lock:
            if key not in self._zygotes and len(self._zygotes) < self.MAX_ZYGOTES:
                self._zygotes[key] = _Zygote(dict(env))
            return self._zygotes.get(key)

    def spawn(
        self, cmd: list[str], *, env: dict[str, str], stdout, stderr, cwd: Path | str | None = None
    ) -> WarmChild | subprocess.Popen:
        """Start ``cmd`` (``[sys.executable, script, *args]`` or ``[sys.executable, "-m", module, *args]``) as a
        new session with stdout and stderr into the given open files (``stderr=subprocess.STDOUT`` shares
        stdout's); a fresh interpreter where the pool cannot stand in for one (see the module docstring)."""
        script_run = len(cmd) >= 2 and cmd[0] == sys.executable and not cmd[1].startswith("-")
        module_run = len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m"
        zygote = self.zygote_for(env) if (script_run or module_run) and self.usable(env) else None
        if zygote is None or not zygote.start():
            return subprocess.Popen(
                cmd, env=env, stdout=stdout, stderr=stderr, start_new_session=True, cwd=cwd
            )
        return zygote.spawn(cmd, env=env, stdout=stdout, stderr=stderr, cwd=cwd)

    def close(self) -> None:
        for zygote in self._zygotes.values():
            zygote.close()


class _Zygote:
    """One zygote process (this file run as a script) and the exit statuses of its children."""

    def __init__(self, env: dict[str, str]) -> None:
        self._env = env
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._codes: dict[int, int] = {}  # pid -> exit status, as Popen.returncode
        self._next = 0
        self._dead = False

    def spawn(
        self, cmd: list[str], *, env: dict[str, str], stdout, stderr, cwd: Path | str | None
    ) -> WarmChild:
        out_path = stdout.name
        err_path = out_path if stderr is subprocess.STDOUT else stderr.name
        with self._lock:
            self._next += 1
            ident = self._next
            request = {"id": ident, "argv": cmd[1:], "env": env, "cwd": str(cwd) if cwd else None,
                       "stdout": out_path, "stderr": err_path}  # fmt: skip
            assert self._proc is not None and self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
        with self._changed:
            if not self._changed.wait_for(lambda: ident in self._pids or self._dead, timeout=30):
                raise AssertionError(f"the warm pool's zygote did not start {cmd[1]} within 30 s")
            if ident not in self._pids:
                raise AssertionError(f"the warm pool's zygote died before starting {cmd[1]}")
            return WarmChild(self, self._pids[ident])

    def start(self) -> bool:
        with self._lock:
            if self._proc is None:
                self._proc = subprocess.Popen(
                    [sys.executable, __file__], env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    start_new_session=True,
                )  # fmt: skip
                threading.Thread(target=self._read, daemon=True, name="warm-pool-reader").start()
            return not self._dead

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            kind, first, second = line.decode().split()
            with self._changed:
                if kind == "started":
                    self._pids[int(first)] = int(second)
                else:
                    self._codes[int(first)] = int(second)
                self._changed.notify_all()
        with self._changed:
            self._dead = True
            self._changed.notify_all()

    def _code(self, pid: int, *, block: bool, timeout: float | None = None) -> int | None:
        with self._changed:
            if block and not self._changed.wait_for(
                lambda: pid in self._codes or self._dead, timeout=timeout
            ):
                raise subprocess.TimeoutExpired(f"warm pool child {pid}", timeout or 0)
            if pid not in self._codes and self._dead:
                raise AssertionError(f"the warm pool's zygote died; the exit status of child {pid} is lost")
            return self._codes.get(pid)

    def close(self) -> None:
        """End the zygote (its children are the tests' to kill, and each harness has killed its own)."""
        if self._proc is not None:
            with contextlib.suppress(OSError):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


# ---- the zygote: this file run as a script ----


def _child(request: dict) -> None:
    """In the forked child: become ``python script args``, run the script, and end as the interpreter would
    (`loom.launch.worker.finish`); never returns."""
    import runpy

    os.setsid()
    if request["cwd"]:
        os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
    same = request["stderr"] == request["stdout"]
    err = out if same else os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {null, out, err}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # a fresh interpreter seeds its own; a fork would share the zygote's
        sys.modules["numpy"].random.seed()
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":  # `python -m module`: the working directory first on sys.path, argv[0] its file
            sys.argv = ["-m", *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = launcher_zygote.exit_code(stop.code)
    except BaseException as error:  # as the interpreter reports an uncaught exception: sys.excepthook (loom's
        sys.excepthook(type(error), error, error.__traceback__)  # notes it, so shutdown skips its barrier), 1
        code = 1
    launcher_zygote.finish(code)


def _zygote() -> None:
    import importlib
    import select

    for module in WARM_MODULES:
        importlib.import_module(module)

    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        if readable:
            data = os.read(0, 1 << 20)
            if not data:
                return  # the test session ended
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request)  # never returns
                os.write(1, f"started {request['id']} {pid}\n".encode())
        for pid, code in launcher_zygote.reaped():
            os.write(1, f"exited {pid} {code}\n".encode())


if __name__ == "__main__":
    _zygote()
