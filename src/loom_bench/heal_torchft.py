"""The torchft side of the healing benchmark: a lighthouse on loopback and one process per replica group.

torchft 0.2.0 is never a dependency of loom: it lives in its own virtual environment
(``requirements/bench-torchft.txt``; default ``/work/venvs/torchft``, or ``--torchft-python``), and this module runs
its processes with that interpreter, so the harness (`loom_bench.heal_compare`) itself needs neither torchft nor
torch. Two entry points:

- `TorchftSide`, used by the harness: starts the lighthouse (``python -m loom_bench.heal_torchft lighthouse``) and
  the workers (`loom_bench.heal_torchft_worker`), and starts a replacement at once when the harness kills one (a
  fresh process with the same replica index; torchft gives it a fresh replica id and it heals from a live peer);
- ``lighthouse``: torchft's in-process ``LighthouseServer`` bound to 127.0.0.1; it prints its port, then serves
  until its standard input closes (the harness holds it open), so it never outlives the harness.

The lighthouse settings are torchft's defaults unless given: a replica is declared dead when it has not
heart-beaten for ``heartbeat_timeout_ms`` (5000), and a quorum that lacks a heart-beating replica waits up to
``join_timeout_ms`` (60000) for it. Both shape the figures; the report states them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PYTHON = "/work/venvs/torchft/bin/python"
SRC = Path(__file__).resolve().parents[1]


@dataclass
class TorchftSettings:
    """What the torchft side is run with (each field is printed in the report)."""

    python: str = DEFAULT_PYTHON
    """the interpreter of the virtual environment torchft 0.2.0 is installed in"""
    min_replicas: int = 2
    """the lighthouse's min_replicas and each Manager's min_replica_size"""
    heartbeat_timeout_ms: int = 5000
    """torchft's default: a replica silent this long is dropped from the quorum"""
    join_timeout_ms: int = 60000
    """torchft's default: how long a quorum waits for a heart-beating replica that has not asked to join"""
    quorum_tick_ms: int = 100
    """torchft's default: how often the lighthouse re-checks a pending quorum"""
    timeout_s: float = 30.0
    """the Manager's timeout for its RPCs and checkpoint transfer (torchft's train_ddp.py: 30 s)"""
    pg_timeout_s: float = 5.0
    """gloo's timeout for a collective (train_ddp.py on CPU: 5 s). A survivor whose all-reduce failed stops
    exchanging, so the other survivors' all-reduce waits this long: it bounds figure (a) whenever the kill lands
    in the gradient exchange"""
    ddp_hook: str = "completed"
    """torchft's DDP hook with its error path completed, or "original" (see `loom_bench.heal_torchft_worker`)"""


@dataclass
class TorchftSide:
    """The torchft processes of one run. `start`, then `replace` after each kill, then `close` (always)."""

    records: Path
    replicas: int
    steps: int
    batch: int
    hidden: int
    settings: TorchftSettings = field(default_factory=TorchftSettings)
    name: str = "torchft"
    workers: dict[int, subprocess.Popen] = field(default_factory=dict)
    _lighthouse: subprocess.Popen | None = None
    _address: str = ""
    _spawned: int = 0

    def describe(self) -> dict[str, object]:
        return {"side": self.name, **self.settings.__dict__}

    def start(self) -> None:
        if not Path(self.settings.python).exists():
            raise SystemExit(
                f"heal_compare --side torchft: no interpreter at {self.settings.python}. HINT: python3.11 -m venv "
                "/work/venvs/torchft && /work/venvs/torchft/bin/pip install -r requirements/bench-torchft.txt "
                "(torch first, see the file), or pass --torchft-python"
            )
        s = self.settings
        command = [s.python, "-m", "loom_bench.heal_torchft", "lighthouse", "--min-replicas", str(s.min_replicas),
                   "--heartbeat-timeout-ms", str(s.heartbeat_timeout_ms), "--join-timeout-ms",
                   str(s.join_timeout_ms), "--quorum-tick-ms", str(s.quorum_tick_ms)]  # fmt: skip
        log = open(self.records / "lighthouse.log", "wb")  # noqa: SIM115 (the child holds it)
        self._lighthouse = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self._env(), cwd=SRC
        )
        assert self._lighthouse.stdout is not None
        line = self._lighthouse.stdout.readline().decode().strip()
        if not line.isdigit():
            self.close()
            raise SystemExit(f"the torchft lighthouse did not start (printed {line!r}); see {log.name}")
        self._address = f"http://127.0.0.1:{line}"
        for replica in range(self.replicas):
            self.workers[replica] = self._spawn(replica)

    def replace(self, replica: int) -> None:
        """Start the killed replica's replacement at once (torchft has no launcher of its own that does)."""
        self.workers[replica] = self._spawn(replica)

    def finished(self) -> bool:
        return all(worker.poll() is not None for worker in self.workers.values())

    def failures(self) -> list[str]:
        """Workers that ended with an error (not killed by the harness: those were replaced in `workers`)."""
        return [
            f"replica {r} (pid {w.pid}) exited with {w.returncode}; see {self.records}/replica{r}-*.log"
            for r, w in self.workers.items()
            if w.returncode not in (None, 0)
        ]

    def close(self) -> None:
        """Kill what is still running and stop the lighthouse; safe to call twice and after a failure."""
        for worker in self.workers.values():
            if worker.poll() is None:
                worker.kill()
            worker.wait()
        if self._lighthouse is not None and self._lighthouse.poll() is None:
            assert self._lighthouse.stdin is not None
            self._lighthouse.stdin.close()
            try:
                self._lighthouse.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._lighthouse.kill()
                self._lighthouse.wait()

    def _spawn(self, replica: int) -> subprocess.Popen:
        self._spawned += 1
        command = [self.settings.python, str(SRC / "loom_bench" / "heal_torchft_worker.py"),
                   "--records", str(self.records), "--replica", str(replica), "--lighthouse", self._address,
                   "--steps", str(self.steps), "--batch", str(self.batch), "--hidden", str(self.hidden),
                   "--min-replicas", str(self.settings.min_replicas),
                   "--timeout", str(self.settings.timeout_s),
                   "--pg-timeout", str(self.settings.pg_timeout_s), "--ddp-hook", self.settings.ddp_hook]  # fmt: skip
        log = open(self.records / f"replica{replica}-{self._spawned}.log", "wb")  # noqa: SIM115
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self._env())

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
        env.pop("MASTER_ADDR", None)
        env.pop("MASTER_PORT", None)
        return env


def serve_lighthouse(argv: list[str]) -> int:
    """Run torchft's LighthouseServer on 127.0.0.1 until standard input closes; print the port first."""
    parser = argparse.ArgumentParser(prog="python -m loom_bench.heal_torchft lighthouse")
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--heartbeat-timeout-ms", type=int, required=True)
    parser.add_argument("--join-timeout-ms", type=int, required=True)
    parser.add_argument("--quorum-tick-ms", type=int, required=True)
    args = parser.parse_args(argv)
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(server.address().rsplit(":", 1)[1], flush=True)
    try:
        sys.stdin.buffer.read()  # returns when the harness closes the pipe (or dies)
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["lighthouse"]:
        sys.exit(serve_lighthouse(sys.argv[2:]))
    sys.exit(
        "usage: python -m loom_bench.heal_torchft lighthouse ...; the benchmark: python -m loom_bench.heal_compare"
    )
