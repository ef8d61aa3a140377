"""Parameter-server processes started beside the workers by ``loom run --servers K``.

The servers are not part of the elastic worker group: they start before it, survive worker restarts, and are
stopped (SIGTERM, then SIGKILL) once the workers are done. Each runs ``python -m loom.ps.server --index i
--num-servers K --bind ADDR:PORT`` through `loom.launch.worker`, so it dies with the launcher too. Workers learn
the addresses from ``LOOM_PS_ADDRS``; every process gets the job secret in ``LOOM_JOB_SECRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from loom.launch.agent import free_port

__all__ = ["server_processes"]


def _prefix_lines(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def server_processes(count: int, bind_host: str) -> Iterator[list[str]]:
    """Start ``count`` servers listening on ``bind_host``; yields their ``ADDR:PORT`` list."""
    if count == 0:
        yield []
        return
    addresses = [f"{bind_host}:{free_port(bind_host)}" for _ in range(count)]
    procs: list[subprocess.Popen] = []
    try:
        for index, address in enumerate(addresses):
            cmd = [sys.executable, "-u", "-m", "loom.launch.worker", "-m", "loom.ps.server",
                   "--index", str(index), "--num-servers", str(count), "--bind", address]  # fmt: skip
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ)
            )
            procs.append(proc)
            threading.Thread(
                target=_prefix_lines, args=(proc.stdout, f"[server{index}]: "), daemon=True
            ).start()
        yield addresses
    finally:
        _stop(procs)
