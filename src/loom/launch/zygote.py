"""Workers forked from one process that has imported torch and loom: the launcher's zygote.

A fresh worker interpreter spends ~2 s of CPU importing torch and loom (torch.optim's first optimizer imports
torch._dynamo, and sympy with it) and ~1 s tearing them down at exit, on every rank: on a 2-core host, four
workers spend ~12 CPU-seconds in imports before the first step, and a replacement for a lost worker keeps the
survivors waiting that long. So `loom run` starts one zygote per node, which imports what every worker imports
first (`WARM`), and each worker, restarted and replacement workers included, is a ``fork()`` of it that runs
`loom.launch.worker` as ``python -u -m loom.launch.worker SCRIPT ARGS`` would. Under ``--on-worker-failure
continue|heal`` the launcher's own supervisor (`loom.launch.supervise`, `loom.launch.heal_nodes`) forks them; under
PyTorch's elastic agent (``restart``, the default; `loom.launch.elastic`) the agent's handler of each worker
process asks the zygote for it, in a session of its own as the agent starts them:

- the launcher sends each request (the worker's environment and arguments, one JSON line bounded by
  `MAX_REQUEST`) with the worker's stdin, stdout and stderr as file descriptors (``SCM_RIGHTS``) over a
  ``socketpair``: no address, nothing listens, only the launcher holds the other end;
- the child replaces ``os.environ`` (so C-level ``getenv`` sees it too), ``sys.argv`` and its standard streams,
  reseeds numpy's global generator if the zygote imported it (``random`` reseeds itself at fork), dies with the
  zygote (PDEATHSIG), which dies with the launcher, and ends as an interpreter does: non-daemon threads joined,
  ``atexit`` run, files flushed, an uncaught exception's traceback printed (`finish`), without the teardown;
- the zygote reaps its children and reports each exit status; `Forked` gives the launcher the part of
  `subprocess.Popen` it uses (``poll``, ``wait``, ``kill``, ``terminate``, ``returncode``, ``stdout``...).

What a fork cannot change is what was decided when the interpreter, torch or OpenMP started: the zygote starts
with rank 0's environment, and a worker whose startup variables (`STARTUP_PREFIXES`) differ from it is a fresh
interpreter, as is every worker when the zygote cannot start or died; ``OMP_NUM_THREADS`` is applied with
``torch.set_num_threads``; every worker shares the zygote's hash seed (a fresh interpreter draws its own).
``LOOM_ZYGOTE=0`` turns it off (every worker a fresh interpreter).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["MAX_REQUEST", "STARTUP_PREFIXES", "WARM", "Forked", "Zygote", "finish", "main", "reaped"]

MAX_REQUEST = 1 << 20
"""The longest request a zygote reads (the environment and arguments of one worker)."""
MAX_REPLY = 4096
"""The longest line the launcher reads from its zygote (a pid or an exit status)."""
WARM = ("torch", "torch.distributed", "numpy.random", "loom.parallel", "loom.train.fit", "loom.launch.worker",
        "torch._dynamo", "torch.nn.parallel", "torch.distributed.elastic.multiprocessing.errors")  # fmt: skip
"""What the zygote imports: what every worker imports first, and what its first optimizer and step import."""
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "NPY_", "TORCH_", "TORCHDYNAMO",
                    "TORCHINDUCTOR", "LD_", "MALLOC_", "CUDA")  # fmt: skip
"""Variables read when the interpreter, torch or OpenMP start: a worker whose values differ from the zygote's is
a fresh interpreter."""
_FD_ENV = "LOOM_ZYGOTE_FD"
ROOM = 4096
"""Bytes of command line the zygote is started with (a placeholder argument), which each forked worker rewrites
to its own command (`retitle`), so that ``ps``, ``pgrep -f`` and ``pkill -f train.py`` find it by its script."""


def retitle(argv: list[str]) -> None:
    """Show ``argv`` as this process's command line (``/proc/self/cmdline``), cut to the room the process started
    with: the kernel reads it from the memory between ``arg_start`` and ``arg_end`` (``/proc/self/stat``), where
    the interpreter's own copy of its arguments no longer is (``sys.argv`` is separate), as ``setproctitle`` does.
    Linux only; elsewhere, or if anything fails, the command line stays as it was."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49, counted from the pid's 1
        text = "\0".join(argv).encode()[: max(0, end - start - 1)]
        ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)
    except (OSError, ValueError, IndexError):
        return


def startup_view(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k != "OMP_NUM_THREADS"}


class Forked:
    """A worker forked by the zygote, as much of `subprocess.Popen` as the launcher uses."""

    def __init__(
        self, zygote: Zygote, pid: int, args: list[str], stdout: IO[str] | None, stderr: IO[str] | None
    ) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.stdout, self.stderr, self.stdin = stdout, stderr, None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid, wait=True, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's side (see the module docstring): `start` it with rank 0's environment, `fork` each worker
    (None: start a fresh interpreter instead), `close` it once every worker it forked has ended."""

    def __init__(self, worker_args: list[str], env: dict[str, str]) -> None:
        runs_worker = "loom.launch.worker" in worker_args
        at = worker_args.index("loom.launch.worker") if runs_worker else 1
        self.interpreter, self.args = worker_args[: at - 1], worker_args[at + 1 :]
        self.env = env
        self.enabled = runs_worker and os.environ.get("LOOM_ZYGOTE", "1") != "0"  # (else: not a loom worker)
        self.proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._changed = threading.Condition()
        self._replies: list[dict[str, Any]] = []
        self._codes: dict[int, int] = {}
        self._dead = False

    def start(self, env: dict[str, str] | None = None) -> None:
        """Start the zygote (with ``env``, else the environment given at construction), once."""
        if not self.enabled or self.proc is not None:
            return
        self.env = env if env is not None else self.env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, *self.interpreter, "-m", "loom.launch.zygote", "." * ROOM],
                env={**self.env, _FD_ENV: str(theirs.fileno())},
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        self._sock = ours
        threading.Thread(target=self._read, daemon=True, name="loom-zygote-reader").start()

    def command(self) -> list[str]:
        """The command a fresh worker runs, which a forked one stands for."""
        return [sys.executable, *self.interpreter, "-m", "loom.launch.worker", *self.args]

    def fork(self, env: dict[str, str], stdout: IO | None = None, stderr: IO | None = None,
             new_session: bool = False) -> Forked | None:  # fmt: skip
        """Worker with ``env``, forked, its output into ``stdout`` and ``stderr`` (open files) or else into pipes
        (`Forked.stdout`, `Forked.stderr`), in a session of its own if ``new_session`` (as ``Popen(...,
        start_new_session=True)``); None when the zygote is off, dead, refuses, or started differently."""
        if self._sock is None or self._dead or startup_view(env) != startup_view(self.env):
            return None
        request = {"env": env, "argv": self.args, "session": new_session, "title": self.command()}
        line = (json.dumps(request) + "\n").encode()
        if len(line) > MAX_REQUEST:
            return None
        ours: list[int] = []  # descriptors made here, closed here once sent
        pipes = []
        try:
            os.fstat(0)
            stdin = 0  # a fresh worker inherits the launcher's standard input: so does a forked one
        except OSError:
            stdin = os.open(os.devnull, os.O_RDONLY)
            ours.append(stdin)
        streams = []
        for given in (stdout, stderr):
            if given is not None:
                streams.append(given.fileno())
            else:
                read, write = os.pipe()
                pipes.append(read)
                ours.append(write)
                streams.append(write)
        pid = None
        try:
            with self._changed:  # one request at a time: its reply is the next one
                self._replies.clear()
                socket.send_fds(self._sock, [line[:1]], [stdin, *streams])
                self._sock.sendall(line[1:])
                self._changed.wait_for(lambda: self._replies or self._dead, timeout=30.0)
                pid = (self._replies.pop() if self._replies else {}).get("pid")
        except (OSError, ValueError):
            pass
        finally:
            for fd in ours:
                os.close(fd)
        if not isinstance(pid, int):
            for fd in pipes:
                os.close(fd)
            return None
        opened = iter([open(fd, errors="replace") for fd in pipes])  # noqa: SIM115
        out = None if stdout is not None else next(opened)
        err = None if stderr is not None else next(opened)
        return Forked(self, pid, self.command(), out, err)

    def status(self, pid: int, wait: bool = False, timeout: float | None = None) -> int | None:
        """``pid``'s exit status as `subprocess.Popen.returncode` says it; None while it runs. A worker of a
        zygote that died died with it (PDEATHSIG): -9."""
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: pid in self._codes or self._dead, timeout=timeout)
            if pid not in self._codes and self._dead:
                return -signal.SIGKILL
            return self._codes.get(pid)

    def _read(self) -> None:
        assert self._sock is not None
        with self._sock.makefile("rb") as lines:
            while True:
                line = lines.readline(MAX_REPLY + 1)
                if not line or len(line) > MAX_REPLY:
                    break
                try:
                    message = json.loads(line)
                except ValueError:
                    break
                with self._changed:
                    if "exited" in message:
                        self._codes[int(message["exited"])] = int(message["status"])
                    else:
                        self._replies.append(message)
                    self._changed.notify_all()
        with self._changed:
            self._dead = True
            self._changed.notify_all()

    def close(self) -> None:
        """End the zygote; call it once every worker it forked has ended (they die with it)."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            assert self._sock is not None
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._sock is not None:
            self._sock.close()


# ---- the zygote's side: python -m loom.launch.zygote ----


def _read_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One request and its three descriptors; None when the launcher closed its end."""
    first, fds, _flags, _addr = socket.recv_fds(sock, 1, 3)
    if not first:
        return None
    data = bytearray(first)
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk or len(data) + len(chunk) > MAX_REQUEST:
            raise SystemExit(f"loom zygote: a request over {MAX_REQUEST} bytes or cut short; refused")
        data += chunk
    request = json.loads(data)
    env, argv = request.get("env"), request.get("argv")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise SystemExit("loom zygote: the request's env must map names to strings")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise SystemExit("loom zygote: the request's argv must be a non-empty list of strings")
    if len(fds) != 3:
        raise SystemExit(f"loom zygote: a request needs stdin, stdout and stderr; got {len(fds)} descriptors")
    return request, fds


def _become(request: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    """In the forked child: become the worker, run it, end as the interpreter would; never returns."""
    code = 1
    try:
        if request.get("session"):
            os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
        sock.close()
        for target, fd in enumerate(fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        from loom.launch.worker import die_with_parent

        die_with_parent()  # (the zygote, which dies with the launcher)
        os.environ.clear()
        os.environ.update(request["env"])
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


def exit_code(code: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into a status: None 0, an int itself, else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def finish(code: int) -> None:
    """End a forked process as ``Py_FinalizeEx`` would, as far as a program can observe: non-daemon threads
    joined, ``atexit`` run, every open file flushed; then ``os._exit``, without freeing each object one by one
    (about 1 s of CPU with torch and loom loaded; loom cleans up in ``atexit``, not in ``__del__``)."""
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
    retitle([sys.executable, "-m", "loom.launch.zygote"])  # (its placeholder argument is the workers' room)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle (it stops the workers)
    sock = socket.socket(fileno=int(os.environ.pop(_FD_ENV)))
    for name in WARM:
        importlib.import_module(name)
    alone = threading.active_count() == 1  # a fork copies one thread: only fork a process that has one
    while True:
        readable, _, _ = select.select([sock], [], [], 0.01)
        for ended, code in reaped():
            sock.sendall((json.dumps({"exited": ended, "status": code}) + "\n").encode())
        if not readable:
            continue
        got = _read_request(sock)
        if got is None:  # the launcher is done: its workers have ended
            return
        request, fds = got
        pid = None
        if alone:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become(request, fds, sock)
        for fd in fds:
            os.close(fd)
        sock.sendall((json.dumps({"pid": pid}) + "\n").encode())


if __name__ == "__main__":
    main()
