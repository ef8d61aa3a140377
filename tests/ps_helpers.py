"""Start parameter servers and workers for tests the way ``loom run --servers K`` does, always cleaned up.

Servers run ``python -m loom.ps.server --index i --num-servers K --bind 127.0.0.1:PORT`` with ``LOOM_JOB_SECRET``;
workers get ``LOOM_JOB_SECRET`` and ``LOOM_PS_ADDRS`` plus the usual RANK/WORLD_SIZE. Every process gets its own
session and is killed with its group in ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from conftest import WARM_POOL, WORKERS, free_port


def kill_group(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class Servers:
    secret: str
    addresses: list[str]
    procs: list  # subprocess.Popen or warm_pool.WarmChild
    logs: list[Path]
    extra: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {"LOOM_JOB_SECRET": self.secret, "LOOM_PS_ADDRS": ",".join(self.addresses)}

    def log(self, index: int) -> str:
        return self.logs[index].read_text()

    def start(self, index: int) -> None:
        """(Re)start server ``index`` on its address."""
        cmd = [sys.executable, "-m", "loom.ps.server", "--index", str(index),
               "--num-servers", str(len(self.addresses)), "--bind", self.addresses[index], *self.extra]  # fmt: skip
        env = dict(os.environ, LOOM_JOB_SECRET=self.secret, OMP_NUM_THREADS="1")
        out = open(self.logs[index], "a")  # noqa: SIM115 - the child keeps it
        proc = WARM_POOL.spawn(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        if index < len(self.procs):
            self.procs[index] = proc
        else:
            self.procs.append(proc)

    def kill(self, index: int) -> None:
        kill_group(self.procs[index])


@contextlib.contextmanager
def parameter_servers(count: int, *extra: str) -> Iterator[Servers]:
    """``count`` servers on free loopback ports with a fresh secret; killed on exit."""
    logdir = tempfile.TemporaryDirectory(prefix="loom-ps-")
    servers = Servers(
        secrets.token_hex(32),
        [f"127.0.0.1:{free_port()}" for _ in range(count)],
        [],
        [Path(logdir.name) / f"server{i}.log" for i in range(count)],
        list(extra),
    )
    try:
        for i in range(count):
            servers.start(i)
        yield servers
    finally:
        for proc in servers.procs:
            kill_group(proc)
        logdir.cleanup()


def run_ps_workers(
    script: str,
    world_size: int,
    config: dict,
    env: dict[str, str],
    *,
    timeout: float = 60.0,
    may_die: frozenset[int] = frozenset(),
) -> dict[int, list[dict]]:
    """Run tests/workers/<script> as ranks 0..world_size-1 with ``config`` (JSON) as argument and ``env`` added.

    Returns each rank's JSON output lines. Ranks in ``may_die`` may exit non-zero (fault injection)."""
    logs = tempfile.TemporaryDirectory(prefix="loom-test-")
    procs, outs = [], []
    for rank in range(world_size):
        child_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                         LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", **env)  # fmt: skip
        out = open(Path(logs.name) / f"{rank}.out", "w+")  # noqa: SIM115 - closed in finally
        outs.append(out)
        cmd = [sys.executable, str(WORKERS / script), json.dumps(config)]
        procs.append(WARM_POOL.spawn(cmd, env=child_env, stdout=out, stderr=subprocess.STDOUT))

    def text(rank: int) -> str:
        outs[rank].flush()
        outs[rank].seek(0)
        return outs[rank].read()

    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in may_die]
            if failed:
                r = failed[0]
                raise AssertionError(f"rank {r} of {script} exited {codes[r]}:\n{text(r)[-4000:]}")
            if all(c is not None for c in codes):
                return {
                    r: [json.loads(line) for line in text(r).splitlines() if line.startswith("{")]
                    for r in range(world_size)
                }
            if time.monotonic() > deadline:
                stuck = [r for r, c in enumerate(codes) if c is None]
                raise AssertionError(
                    f"ranks {stuck} of {script} did not finish within {timeout} s:\n{text(stuck[0])}"
                )
            time.sleep(0.05)
    finally:
        for proc in procs:
            kill_group(proc)
        for f in outs:
            f.close()
        logs.cleanup()
