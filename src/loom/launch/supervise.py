"""Run a one-node job's workers as plain child processes, so that a dead worker does not stop the others.

``loom run --on-worker-failure continue``, for asynchronous parameter-server training, where the servers hold the
model and the survivors can finish (the default, `loom.launch.restarts`, stops the group; which strategies refuse
``continue``, and why: docs/fault-tolerance.md). Each worker runs `loom.launch.worker` (dying with the launcher)
with torchrun's environment (`worker_env`) and joins loom's authenticated store, hosted by the launcher on
loopback, so any worker, rank 0 included, may die once all joined; one that dies before all have joined leaves the
others waiting in ``loom.init()`` until its timeout. A dead worker is named on one line. `start_worker`,
`worker_env` and `stop_processes` serve ``stop`` and ``heal`` (`loom.launch.heal_nodes`) too.

Exit status: 0 when every worker succeeded or was killed by a signal (the OOM killer...) and at least one
succeeded (a warning names the lost ranks); 1 when a worker raised or exited non-zero (a bug is not a lost worker)
or none succeeded; ``128 + signal`` when the launcher itself was stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from loom.errors import LauncherStopped
from loom.launch.zygote import Zygote

__all__ = [
    "LauncherStopped",
    "Placement",
    "Worker",
    "describe_exit",
    "end_workers",
    "exception_of",
    "exit_cause",
    "exit_text",
    "pump",
    "start_worker",
    "stop_processes",
    "stopped_by_signals",
    "supervise_workers",
    "worker_env",
]

TAIL_LINES = 400


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen
    error_file: Path
    readers: list[threading.Thread]
    reported: bool = False
    session: bool = False
    """Whether it leads a session (and process group) of its own, which it shares with the processes it starts."""
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    """The last lines of its stderr (its stacks, when the healing launcher asks for them: `loom.launch.heal`)."""


def pump(
    stream: IO[str], prefix: str, out: IO[str] | None = None, log_path: Path | None = None,
    tail: deque[str] | None = None,
) -> None:  # fmt: skip
    """Copy a child's stream to ``out`` (None: our stdout), each line after ``prefix``, and to its log file if
    any; close the stream at its end (the launcher keeps each ended worker's record: an open pipe would leak
    descriptors per heal). A line is read at most a MiB at a time, so a child's endless line costs bounded
    memory."""
    out, starts = out or sys.stdout, True
    with stream, open(log_path or os.devnull, "w") as log:
        for line in iter(lambda: stream.readline(1 << 20), ""):
            out.write(prefix + line if starts else line)
            out.flush()
            log.write(line)
            starts = line.endswith("\n")
            if tail is not None:
                tail.append(line)


@dataclass(frozen=True)
class Placement:
    """Where this node's workers sit in a job of several nodes (`loom.launch.heal_nodes`): the global rank of
    its first worker, the job's world size, this node's rank and count, and node 0's store address."""

    first_rank: int
    world: int
    node_rank: int
    nnodes: int
    master_addr: str


def worker_env(
    rank: int, nproc: int, store_port: int, run_id: str, error_file: Path, policy: str = "continue",
    generation: int = 0, placement: Placement | None = None, overrides: dict[str, str] | None = None,
) -> dict[str, str]:  # fmt: skip
    """What torchrun would set for this worker (attempt 0 unless ``overrides`` say otherwise), on top of this
    environment: one node unless ``placement`` says otherwise (``rank`` is then the global rank)."""
    where = placement or Placement(0, nproc, 0, 1, "127.0.0.1")
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank - where.first_rank),
        GROUP_RANK=str(where.node_rank),
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        WORLD_SIZE=str(where.world),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE=str(where.nnodes),
        ROLE_WORLD_SIZE=str(where.world),
        MASTER_ADDR=where.master_addr,
        MASTER_PORT=str(store_port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_ERROR_FILE=str(error_file),
        LOOM_STORE_PREFIX=f"loom/{run_id}/job/",
        LOOM_ON_WORKER_FAILURE=policy,  # a strategy that cannot go on without a lost rank refuses to start
        LOOM_HEAL_GENERATION=str(generation),
    )
    env.update(overrides or {})
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


def start_worker(
    rank: int, nproc: int, worker_args: list[str], store_port: int, run_id: str, logs: Path,
    policy: str = "continue", generation: int = 0, placement: Placement | None = None, zygote: Zygote | None = None,
    overrides: dict[str, str] | None = None, new_session: bool = False,
) -> Worker:  # fmt: skip
    """Start worker ``rank`` (a replacement: ``generation`` > 0), forked by ``zygote`` where it can
    (`loom.launch.zygote`), else as a fresh ``python WORKER_ARGS``, in a session of its own if ``new_session``;
    its output is prefixed and logged."""
    name = f"rank{rank}" + (f".heal{generation}" if generation else "")
    error_file = logs / f"{name}.error.json"
    error_file.unlink(missing_ok=True)
    env = worker_env(rank, nproc, store_port, run_id, error_file, policy, generation, placement, overrides)
    proc: Any = zygote.fork(env, new_session) if zygote is not None else None
    if proc is None:
        proc = subprocess.Popen([sys.executable, *worker_args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=new_session)  # fmt: skip
    worker = Worker(rank, proc, error_file, [], session=new_session)
    streams = ((proc.stdout, sys.stdout, "stdout", None), (proc.stderr, sys.stderr, "stderr", worker.tail))
    for stream, out, kind, tail in streams:
        log = logs / f"{name}.{kind}.log"
        thread = threading.Thread(target=pump, args=(stream, f"[rank{rank}]: ", out, log, tail), daemon=True)
        thread.start()
        worker.readers.append(thread)
    return worker


def exception_of(worker: Worker) -> str | None:
    """The ``Type: message`` the worker recorded (`loom.launch.worker` writes it on an uncaught exception); None
    when there is none, or the file is not such a record or past 1 MiB (read within that bound)."""
    try:
        with open(worker.error_file, errors="replace") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return str(message).strip().splitlines()[-1] if message else None


def exit_cause(code: int) -> str:
    """How a process with exit status ``code`` ended: ``killed by SIGKILL`` for -9 (``killed by signal N`` for
    a signal without a name), else ``exit code N``: said of workers and of parameter servers (`loom.launch.servers`)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def exit_text(name: str, code: int, error: str | None) -> str:
    """How a process ``name`` ended, as one line: the signal that killed it, else its status and exception."""
    if code < 0:
        return f"{name} was {exit_cause(code)}"
    return f"{name} failed ({exit_cause(code)}): {error or 'exited without a Python exception'}"


def describe_exit(worker: Worker) -> str:
    return exit_text(f"worker rank {worker.rank}", worker.proc.returncode, exception_of(worker))


def stop_processes(procs: list[Any], grace_s: float) -> None:
    """SIGTERM every process still running, then SIGKILL those not ended within ``grace_s``; a process that leads
    a process group of its own (a worker in its own session) is signalled with its group, the processes it
    started included."""
    for proc in procs:
        if proc.poll() is None:
            _signal(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(proc.pid, signal.SIGKILL)
            proc.wait()


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGTERM, SIGINT, SIGHUP (the terminal closed) and SIGQUIT raise `LauncherStopped` meanwhile (the caller
    stops its workers)."""

    def stop_on(signum: int, _frame: Any) -> None:
        raise LauncherStopped(signum)

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    previous = {s: signal.signal(s, stop_on) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def end_workers(workers: list[Worker], grace_s: float, zygote: Zygote | None = None) -> None:
    """Leave nothing running: the workers stopped (the stopped ones, by SIGSTOP or a debugger, woken first: they
    would hold the SIGTERM pending for the whole grace), the zygote ended, their output read to the end."""
    for w in workers:
        if w.proc.poll() is None and _process_state(w.proc.pid) in ("T", "t"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(w.proc.pid, signal.SIGCONT)
    stop_processes([w.proc for w in workers], grace_s)
    for w in workers:  # what a worker in its own session started and left behind (it holds the output pipes)
        if w.session:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, signal.SIGKILL)
    if zygote is not None:
        zygote.close()
    for w in workers:
        for reader in w.readers:
            reader.join(timeout=5.0)


def _process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except OSError:
        return None
    end = stat.rfind(b")")  # the command name, in parentheses, may itself hold spaces and parentheses
    return stat[end + 2 : end + 3].decode() if end >= 0 else None


def _watch(workers: list[Worker], failure: Callable[[], str | None]) -> bool:
    """Wait for every worker to end, announcing each one that dies while the others go on; True as soon as
    ``failure()`` says the job cannot go on (a parameter server died once too often: the workers are stopped)."""
    said: set[str] = set()
    while True:
        if failure() is not None:
            return True
        running = 0
        for w in workers:
            if w.proc.poll() is None:
                running += 1
            elif w.proc.returncode != 0 and not w.reported:
                w.reported = True
                left = sum(1 for other in workers if other.proc.poll() is None)
                what = describe_exit(w)
                reason = what.partition(": ")[2]
                if reason and reason in said:  # every rank refusing the same setting: said once
                    what = f"worker rank {w.rank} failed the same way"
                said.add(reason)
                print(f"loom run: {what}; {left} other worker(s) go on (--on-worker-failure continue)",
                      file=sys.stderr, flush=True)  # fmt: skip
        if not running:
            return False
        time.sleep(0.1)


def _verdict(workers: list[Worker]) -> int:
    failed = [w for w in workers if w.proc.returncode != 0]
    if not failed:
        return 0
    succeeded = len(workers) - len(failed)
    lost = [w for w in failed if w.proc.returncode < 0]
    reasons = {describe_exit(w).partition(": ")[2] for w in failed}
    if not succeeded and len(reasons) == 1 and not lost:
        print(
            f"loom run: every worker failed the same way (ranks {[w.rank for w in failed]})", file=sys.stderr
        )
        return 1
    print(f"loom run: warning: {succeeded} of {len(workers)} workers finished; "
          f"lost: {'; '.join(describe_exit(w) for w in failed)}", file=sys.stderr)  # fmt: skip
    return 0 if succeeded and len(lost) == len(failed) else 1


def supervise_workers(
    nproc: int,
    worker_args: list[str],
    run_id: str,
    logs: Path,
    grace_s: float,
    failure: Callable[[], str | None] = lambda: None,
) -> int:
    """Start ``nproc`` workers (``python WORKER_ARGS``) on this node and wait for all; see the module docstring.

    The caller has prepared the job's environment (`loom.launch.agent`) and started any servers; ``failure()``
    returns why the job must stop (a parameter server died once too often, already reported), else None: the
    workers are then stopped and the status is 1."""
    from loom.net.store import StoreServer, job_secret

    logs.mkdir(parents=True, exist_ok=True)
    # The store outlives every worker: workers connect as clients, so the death of worker 0 does not take the
    # store down with it.
    store = StoreServer("127.0.0.1", 0, job_secret())

    workers: list[Worker] = []
    zygote = Zygote(worker_args, worker_env(0, nproc, store.port, run_id, logs / "zygote.error.json"))
    try:
        with stopped_by_signals():
            zygote.start()
            for rank in range(nproc):
                workers.append(
                    start_worker(rank, nproc, worker_args, store.port, run_id, logs, zygote=zygote)
                )
            if _watch(workers, failure):
                return 1
    except LauncherStopped as stop:
        print(f"loom run: stopped by signal {stop}; workers were terminated", file=sys.stderr)
        return 128 + stop.signum
    finally:
        end_workers(workers, grace_s, zygote)  # nothing left running, whatever happened above
        store.close()
    return _verdict(workers)
