"""A spare worker for healing: started ahead with torch and loom imported, it becomes a replacement at once.

Most of a replacement's start was its interpreter importing torch and loom (~1.2 s here, more on a loaded host),
while the survivors trained on without it. Under ``--on-worker-failure heal`` the launcher keeps one spare
process per node (`Spare`), started after the workers: it imports what every worker imports, then waits on its
standard input. When a worker dies, the launcher writes the replacement's environment and arguments there as
one JSON line (bounded by `MAX_REQUEST`; a pipe from its own parent, so there is no socket and nothing to
authenticate), and the spare runs `loom.launch.worker` as that rank; the launcher then starts the next spare. A
spare not needed is killed when the job ends (it holds no state), one whose standard input closes without a
request exits 0, and every spare dies with its launcher, as a worker does. The cost: one more process per node
holding the imports (~0.3-0.4 GB of memory here) for the job's life.

What differs from a fresh process: the interpreter and torch started under the spare's environment, which is the
launcher's with the job's variables of rank 0 (`loom.launch.supervise.worker_env`): the variables that differ between
ranks (``RANK``, ``LOCAL_RANK``, the heal generation, the error file) are read by loom, not when Python, torch or
OpenMP start. ``os.environ``, ``sys.argv`` and the output's rank prefix are the replacement's before its script
starts. ``LOOM_HEAL_SPARE=0`` turns spares off (each replacement is a fresh interpreter).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
from typing import IO, Any

__all__ = ["MAX_REQUEST", "Spare", "main"]

MAX_REQUEST = 1 << 20
"""The longest request line a spare reads (the environment and arguments of one worker)."""
WARM = ("torch", "torch.distributed", "loom.parallel", "loom.fit", "loom.launch.worker", "torch._dynamo")
"""What a spare imports while it waits: what every worker imports first, and what its first optimizer and step
import (torch.optim's compile hook imports dynamo, and sympy with it: about a second of CPU)."""


def split_worker_args(worker_args: list[str]) -> tuple[list[str], list[str]]:
    """``[-u, -m, loom.launch.worker, TARGET, ARGS...]`` -> the interpreter's options, the worker's arguments."""
    at = worker_args.index("loom.launch.worker")
    return worker_args[: at - 1], worker_args[at + 1 :]


class Spare:
    """The launcher's side: at most one spare process ready at a time (see the module docstring)."""

    def __init__(self, worker_args: list[str], env: dict[str, str]) -> None:
        self.interpreter, self.args = split_worker_args(worker_args)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.enabled = os.environ.get("LOOM_HEAL_SPARE", "1") != "0"

    def fill(self) -> None:
        """Start a spare unless one is ready (or spares are off)."""
        if not self.enabled or (self.proc is not None and self.proc.poll() is None):
            return
        self.proc = subprocess.Popen(
            [sys.executable, *self.interpreter, "-m", "loom.launch.spare"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def take(self, env: dict[str, str]) -> subprocess.Popen | None:
        """The ready spare, told to become the worker with ``env`` (then a new spare starts); None when there is
        none alive (the caller starts a fresh process)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(json.dumps({"env": env, "argv": self.args}) + "\n")
            proc.stdin.close()
        except OSError:  # it died just now
            proc.kill()
            proc.wait()
            return None
        self.fill()
        return proc

    def close(self) -> None:
        """End the spare that was not needed (it holds no state: killed at once, not waited for)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _read_request(stream: IO[bytes]) -> dict[str, Any] | None:
    line = stream.readline(MAX_REQUEST + 1)
    if not line:
        return None
    if len(line) > MAX_REQUEST or not line.endswith(b"\n"):
        raise SystemExit(f"loom spare: a request over {MAX_REQUEST} bytes; refused")
    request = json.loads(line)
    env, argv = request.get("env"), request.get("argv")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise SystemExit("loom spare: the request's env must map names to strings")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise SystemExit("loom spare: the request's argv must be a non-empty list of strings")
    return request


def main() -> None:
    from loom.launch.worker import die_with_parent

    die_with_parent()
    for name in WARM:
        importlib.import_module(name)
    request = _read_request(sys.stdin.buffer)
    if request is None:  # the job ended without needing this spare
        return
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:  # OpenMP read the spare's value when torch loaded
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = ["loom.launch.worker", *request["argv"]]
    from loom.launch import worker

    worker.main()


if __name__ == "__main__":
    main()
