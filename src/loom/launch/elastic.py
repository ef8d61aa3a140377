"""PyTorch's elastic agent as `loom run` drives it: the same agent, which says what it does.

The agent (the engine behind ``torchrun``) restarts the worker group silently. Here, each restart prints one line
naming the failed rank(s), the attempt and where training resumes, and `run_agent` returns how many restarts
there were, for the job's summary line (`loom.launch.agent`).

This is ``torch.distributed.launcher.api.launch_agent`` without what loom does not use (the health-check server,
metrics and event handlers, the static rendezvous) and with `_NarratingAgent`, a `LocalElasticAgent` whose
monitoring step reports failures that will be retried.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.rendezvous.api import RendezvousHandler

from loom.launch import tail_lines
from loom.launch.supervise import exit_cause
from loom.launch.zygote import Zygote

if TYPE_CHECKING:
    from loom.launch.spec import LaunchSpec

__all__ = ["failure_text", "restart_line", "root_failure", "run_agent"]

RESUME_NOTE = (
    "a script that checkpoints resumes from its latest checkpoint (loom.fit and hvd.elastic.run do), "
    "one that does not starts over"
)
"""Said of every script, since the launcher cannot tell whether this one uses loom.fit."""


def failure_text(failure: Any) -> str:
    """What a worker's failure was: the signal that killed it (from outside the agent), else the last line of
    the exception it raised, else how it exited."""
    code = failure.exitcode
    lines = [
        line
        for line in _message(failure).splitlines()
        if line.strip() and not line.startswith("To enable traceback")
    ]
    if code is not None and code < 0 and (code != -15 or not lines):
        return exit_cause(code)
    if lines and not lines[-1].startswith("Signal "):
        return lines[-1].strip()
    return f"exited with code {code} without a Python exception"


_CONSEQUENCES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "connection to rank")
"""Errors a rank raises because a peer failed first (the agent's timestamps are whole seconds, too coarse to tell)."""


def root_failure(failures: dict[int, Any]) -> int:
    """The rank whose failure caused the others: one killed by a signal from outside (not the agent's SIGTERM:
    SIGKILL, the kernel's OOM killer, a crash), else one that raised an error not about a lost peer, else one
    that raised, else the earliest, else the lowest rank. A rank that lost a killed peer raises too, so a
    signal ranks before an exception."""

    def blame(rank: int) -> tuple[int, int, float, int]:
        f = failures[rank]
        signalled = f.exitcode is not None and f.exitcode < 0 and f.exitcode != -15
        raised = isinstance(f.message, dict) or f.error_file_data.get("message") is not None
        consequence = any(text in _message(f) for text in _CONSEQUENCES)
        order = 0 if signalled else 1 if raised and not consequence else 2 if raised else 3
        return (order, int(f.exitcode == -15), f.timestamp, rank)

    return min(failures, key=blame)


def _message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):  # an error file written by the worker: {"message": "...", "extraInfo": ...}
        message = message.get("message", "")
    return str(message or "").strip()


def restart_line(failures: dict[int, Any], attempt: int, max_restarts: int) -> str:
    """The line printed when the worker group restarts: who failed and how, which attempt this is, and what the
    workers do next. ``failures`` maps global ranks to the agent's ``ProcessFailure`` records (empty when the
    restart was caused by another node)."""
    if failures:
        rank = root_failure(failures)
        cause = f"worker rank {rank} failed ({failure_text(failures[rank])})"
    else:
        cause = "a worker on another node failed"
    return (
        f"loom run: {cause}; restarting the worker group, attempt {attempt + 1} of {max_restarts + 1} "
        f"(--max-restarts {max_restarts}); {RESUME_NOTE}"
    )


class _ForkedHandler(SubprocessHandler):
    """torch's handler of one worker process, the process forked by loom's zygote (`loom.launch.zygote`, started
    with the first worker's environment) where it can be: the same command, output files and own session."""

    def __init__(self, zygote: Zygote, **kwargs: Any) -> None:
        self._zygote = zygote
        super().__init__(**kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Any:
        if list(args) == self._zygote.command():
            self._zygote.start(env)
            forked = self._zygote.fork(env, self._stdout, self._stderr, new_session=True)
            if forked is not None:
                return forked
        return super()._popen(args, env)


class _NarratingAgent(LocalElasticAgent):
    """`LocalElasticAgent` that prints `restart_line` before each restart of the worker group, and whose workers
    fork from ``zygote`` (the restarted ones too)."""

    restarts = 0
    _failures: dict[int, Any] = {}
    zygote: Zygote | None = None
    shutdown_timeout_s = 30

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """torch's, with its subprocess handler (`torch.distributed.elastic.multiprocessing.api`'s
        ``get_subprocess_handler``, which builds each worker's) swapped for `_ForkedHandler` meanwhile; where a
        torch release has no such function, its own."""
        from torch.distributed.elastic.multiprocessing import api as procs

        zygote, original = self.zygote, getattr(procs, "get_subprocess_handler", None)
        if zygote is None or not zygote.enabled or original is None:
            return super()._start_workers(worker_group)
        procs.get_subprocess_handler = lambda **kwargs: _ForkedHandler(zygote, **kwargs)  # type: ignore[assignment]
        try:
            return super()._start_workers(worker_group)
        finally:
            procs.get_subprocess_handler = original

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._wake_stopped_workers(only_if_one_died=True)
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._failures = dict(result.failures)
        return result

    def _wake_stopped_workers(self, only_if_one_died: bool) -> None:
        """SIGCONT the workers stopped by SIGSTOP (or a debugger) once the group is going down: a stopped worker
        holds the SIGTERM that stops the group pending, so torch waited its whole grace before the SIGKILL. Reads
        ``/proc/PID/stat`` of each worker: a few reads per poll."""
        pcontext = self._pcontext
        if pcontext is None:
            return
        states = {pid: _process_state(pid) for pid in pcontext.pids().values()}
        if only_if_one_died and not any(state in (None, "Z", "X") for state in states.values()):
            return
        for pid, state in states.items():
            if state in ("T", "t"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop the group within ``shutdown_timeout_s`` (torch's agent waits its default 30 s here, whatever it was
        given), stopped workers woken first (`_wake_stopped_workers`)."""
        self._wake_stopped_workers(only_if_one_died=False)
        self._shutdown(timeout=self.shutdown_timeout_s)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """torch's, with the grace ``timeout`` on every release: torch 2.11's ``_shutdown`` takes no timeout (its
        process context waits a fixed 30 s), 2.13's does; the rest of what it stops is released here as there."""
        if _SHUTDOWN_TAKES_TIMEOUT:
            super()._shutdown(death_sig, timeout)  # type: ignore[call-arg]
            return
        pcontext, self._pcontext = self._pcontext, None
        super()._shutdown(death_sig)  # its watchdog and health server; no process context left to close
        if pcontext is not None:
            pcontext.close(death_sig, timeout=timeout)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.restarts += 1
        spec = worker_group.spec
        print(restart_line(self._failures, self.restarts, spec.max_restarts), file=sys.stderr, flush=True)
        self._failures = {}
        super()._restart_workers(worker_group)


_SHUTDOWN_TAKES_TIMEOUT = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters
"""Whether this torch release's agent stops its workers within a given grace (2.13 does, 2.11 does not): the
agent's internals are detected, never assumed from one release."""


def _process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except OSError:
        return None
    end = stat.rfind(b")")  # the command name, in parentheses, may itself hold spaces and parentheses
    return stat[end + 2 : end + 3].decode() if end >= 0 else None


def run_agent(spec: LaunchSpec, rendezvous: RendezvousHandler, local_addr: str, args: list[str]) -> int:
    """Run ``spec``'s worker group (``python ARGS`` each) to the end; returns the number of restarts.

    Raises ``ChildFailedError`` (naming every failed rank) when the group failed after its last restart, as
    ``launch_agent`` does; signals reach the caller as the agent's ``SignalException``.
    """
    worker_spec = WorkerSpec(
        role="default",
        local_world_size=spec.nproc,
        entrypoint=sys.executable,
        args=tuple(args),
        rdzv_handler=rendezvous,
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        local_addr=local_addr,
    )
    agent = _NarratingAgent(
        spec=worker_spec,
        logs_specs=DefaultLogsSpecs(log_dir=str(spec.run_dir / "logs"), tee=Std.ALL),
        start_method="spawn",
        log_line_prefix_template="[rank${rank}]: ",
    )
    agent.shutdown_timeout_s = spec.shutdown_timeout_s  # see `_NarratingAgent._shutdown`
    agent.zygote = Zygote([*args], {})
    tail_lines.install()  # the workers' lines reach our output whole
    try:
        result = agent.run()
    finally:
        agent.zygote.close()
    if result.is_failed():
        raise ChildFailedError(name=sys.executable, failures=result.failures)
    return agent.restarts
