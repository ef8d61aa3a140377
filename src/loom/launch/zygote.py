"""Workers forked from one process that has imported torch and loom: the launcher's zygote.

A fresh worker spends seconds of CPU importing torch and loom and tearing them down, on every rank, and a lost
worker's replacement keeps the survivors waiting that long. So `loom run` starts one zygote per node, which imports
what every worker imports first (`WARM`); each worker, restarts and replacements included, is a ``fork()`` of it
that runs `loom.launch.worker` as ``python -u -m loom.launch.worker SCRIPT ARGS`` would (the child's side:
`loom.launch.zygote_process`; the frames, over a ``socketpair`` so nothing listens: `loom.launch.zygote_wire`).
Under ``--on-worker-failure stop`` (`loom.launch.restarts`) each worker runs in a session of its own, as under
torchrun. What a forked worker shares with a fresh one: docs/fault-tolerance.md ("Workers forked from a zygote").

A fork cannot change what was decided when the interpreter, torch or OpenMP started: the zygote starts with rank
0's environment less the per-rank variables (`PER_RANK`); a worker whose startup variables (`STARTUP_PREFIXES`)
differ, or every worker once the zygote failed or died, is a fresh interpreter; ``OMP_NUM_THREADS`` is applied
with ``torch.set_num_threads``. ``LOOM_ZYGOTE=0`` turns it off.
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
import time
from typing import IO, Any

from loom.launch.zygote_process import _FD_ENV, _ROOM_ENV, PER_RANK, ROOM, STARTUP_PREFIXES
from loom.launch.zygote_wire import MAX_REPLY, send_request
from loom.settings import setting

__all__ = ["Forked", "Zygote"]

NOTICE_S = 10.0
"""The launcher says what it waits for once a wait on the zygote has lasted this long, and again as often."""


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

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """The launcher's side: `start` it with rank 0's environment, `fork` each worker (None: start a fresh
    interpreter instead), `close` it once every worker it forked has ended.

    Never two processes for one rank: a request is sent only once the zygote has said it is ready, and once sent
    it is waited for as long as the zygote lives, a line every `NOTICE_S` saying what is waited for; a zygote not
    ready within ``LOOM_ZYGOTE_READY_S`` has forked nothing and is stopped, and every worker then starts as a
    fresh interpreter (one line says so). A zygote that dies before replying took the child it may have forked
    with it (PDEATHSIG, checked against the race with its death in `loom.launch.zygote_process`)."""

    def __init__(self, worker_args: list[str], env: dict[str, str]) -> None:
        runs_worker = "loom.launch.worker" in worker_args
        at = worker_args.index("loom.launch.worker") if runs_worker else 1
        self.interpreter, self.args = worker_args[: at - 1], worker_args[at + 1 :]
        self.env = env
        self.enabled = runs_worker and setting("LOOM_ZYGOTE")  # (else: not a loom worker)
        self.proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._changed = threading.Condition()
        self._sending = threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._codes: dict[int, int] = {}
        self._dead = self._ready = False
        self._requests = 0

    def start(self, env: dict[str, str] | None = None) -> None:
        """Start the zygote (with ``env``, else the environment given at construction, less the variables that
        differ per rank: a forked worker shows its own, `_become`), once."""
        if not self.enabled or self.proc is not None:
            return
        self.env = env if env is not None else self.env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        shared = {k: v for k, v in self.env.items() if k not in PER_RANK}
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, *self.interpreter, "-m", "loom.launch.zygote_process", "." * ROOM],
                env={**shared, _FD_ENV: str(theirs.fileno()), _ROOM_ENV: "." * ROOM},
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        self._sock = ours
        threading.Thread(target=self._read, daemon=True, name="loom-zygote-reader").start()

    @property
    def settled(self) -> bool:
        """Whether a `fork` would not wait for the zygote's imports: it is off, ready, or gone."""
        return not self.enabled or self.proc is None or self._ready or self._dead

    def command(self) -> list[str]:
        """The command a fresh worker runs, which a forked one stands for."""
        return [sys.executable, *self.interpreter, "-m", "loom.launch.worker", *self.args]

    def fork(self, env: dict[str, str], new_session: bool = False) -> Forked | None:
        """Worker with ``env``, forked, its output into pipes (`Forked.stdout`, `Forked.stderr`), in a session of
        its own if ``new_session`` (as ``Popen(..., start_new_session=True)``); None when the zygote is off, dead,
        refuses, or started differently."""
        if self._sock is None or self._dead or startup_view(env) != startup_view(self.env):
            return None
        what = f"worker rank {env.get('RANK', '?')}"
        if not self._wait_ready(what):
            return None
        ours: list[int] = []  # descriptors made here, closed here once sent
        try:
            os.fstat(0)
            stdin = 0  # a fresh worker inherits the launcher's standard input: so does a forked one
        except OSError:
            stdin = os.open(os.devnull, os.O_RDONLY)
            ours.append(stdin)
        pipes = [os.pipe() for _ in range(2)]  # (read, write) for its stdout and its stderr
        streams = [write for _, write in pipes]
        ours += streams
        sent, ident = False, 0
        try:
            with self._sending:
                self._requests += 1
                ident = self._requests
                request = {"id": ident, "env": env, "argv": self.args, "session": new_session,
                           "title": self.command()}  # fmt: skip
                sent = send_request(self._sock, request, [stdin, *streams])
        except (OSError, ValueError):
            sent = False
        finally:
            for fd in ours:
                os.close(fd)
        pid = self._await_reply(ident, what).get("pid") if sent else None
        if not isinstance(pid, int):
            for read, _ in pipes:
                os.close(read)
            return None
        out, err = (open(read, errors="replace") for read, _ in pipes)  # noqa: SIM115
        return Forked(self, pid, self.command(), out, err)

    def _wait_ready(self, what: str) -> bool:
        """Wait for the zygote's imports, a line every `NOTICE_S`; past ``LOOM_ZYGOTE_READY_S``, stop it (it has
        forked nothing: no request was sent) and say that every worker starts fresh. True when it is ready."""
        limit = setting("LOOM_ZYGOTE_READY_S")
        began = time.monotonic()
        with self._changed:
            while not self._changed.wait_for(
                lambda: self.settled, min(NOTICE_S, began + limit - time.monotonic())
            ):
                waited = time.monotonic() - began
                if waited >= limit:
                    break
                _say(f"waiting for the zygote (pid {self._pid()}) to import torch and loom before starting {what} "
                     f"({waited:.0f} s so far, load average {_load()})")  # fmt: skip
            if self._ready or self._dead:
                return not self._dead
            self._dead = True
        _say(f"the zygote (pid {self._pid()}) was not ready after {limit:g} s (a loaded host?); every worker "
             f"starts as a fresh interpreter instead. HINT: LOOM_ZYGOTE_READY_S sets this wait, LOOM_ZYGOTE=0 "
             f"skips the zygote")  # fmt: skip
        if self.proc is not None:
            self.proc.kill()
        return False

    def _await_reply(self, ident: int, what: str) -> dict[str, Any]:
        """The reply to request ``ident``, waited for as long as the zygote lives (a request it read is served,
        so giving up on it would start a second process for the rank); {} when the zygote died."""
        began = time.monotonic()
        with self._changed:
            while not self._changed.wait_for(lambda: ident in self._replies or self._dead, NOTICE_S):
                _say(f"waiting for the zygote (pid {self._pid()}) to fork {what} "
                     f"({time.monotonic() - began:.0f} s so far, load average {_load()})")  # fmt: skip
            return self._replies.pop(ident, {})

    def _pid(self) -> int | str:
        return self.proc.pid if self.proc is not None else "?"

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
                    elif "ready" in message:
                        self._ready = True
                    elif isinstance(message.get("id"), int):
                        self._replies[message["id"]] = message
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


def _say(text: str) -> None:
    print(f"loom run: {text}", file=sys.stderr, flush=True)


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"
