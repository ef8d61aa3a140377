"""PyTorch's elastic agent as `loom run` drives it: the same agent, which says what it does.

The agent (the engine behind ``torchrun``) restarts the worker group silently: a user saw a restart only as a
traceback in one rank's log. Here, each restart prints one line naming the failed rank(s), the attempt and where
training resumes, and `run_agent` returns how many restarts there were, for the summary line at the end of the
job (`loom.launch.agent`).

This is ``torch.distributed.launcher.api.launch_agent`` without what loom does not use (the health-check server,
metrics and event handlers, the static rendezvous) and with `_NarratingAgent`, a `LocalElasticAgent` whose
monitoring step reports failures that will be retried.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousHandler

__all__ = ["AgentOptions", "failure_text", "restart_line", "root_failure", "run_agent"]

RESUME_NOTE = "loom.fit resumes from its latest checkpoint"


@dataclass(frozen=True)
class AgentOptions:
    """What the agent needs from `loom run`'s launch spec."""

    nproc: int
    max_restarts: int
    logs_specs: LogsSpecs
    local_addr: str
    shutdown_timeout_s: int
    monitor_interval_s: float = 0.1


def failure_text(failure: Any) -> str:
    """What a worker's failure was: the last line of the exception it raised, else the signal that killed it."""
    import signal

    message = failure.message
    if isinstance(message, dict):  # an error file written by the worker: {"message": "...", "extraInfo": ...}
        message = message.get("message", "")
    message = str(message or "").strip()
    code = failure.exitcode
    if message and not message.startswith("Signal "):
        return message.splitlines()[-1]
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return "exited without a Python exception"


_CONSEQUENCES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "connection to rank")
"""Errors a rank raises because a peer failed first (the agent's timestamps are whole seconds, too coarse to tell)."""


def root_failure(failures: dict[int, Any]) -> int:
    """The rank whose failure caused the others: one that raised an error not about a lost peer, else one not
    stopped by the agent's SIGTERM, else the earliest, else the lowest rank."""

    def blame(rank: int) -> tuple[int, int, int, float, int]:
        f = failures[rank]
        message = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message or "")
        raised = isinstance(f.message, dict) or f.error_file_data.get("message") is not None
        consequence = any(text in message for text in _CONSEQUENCES)
        stopped_by_agent = f.exitcode == -15
        return (0 if raised else 1, int(consequence), int(stopped_by_agent), f.timestamp, rank)

    return min(failures, key=blame)


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


class _NarratingAgent(LocalElasticAgent):
    """`LocalElasticAgent` that prints `restart_line` before each restart of the worker group."""

    restarts = 0
    _failures: dict[int, Any] = {}

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._failures = dict(result.failures)
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.restarts += 1
        spec = worker_group.spec
        print(restart_line(self._failures, self.restarts, spec.max_restarts), file=sys.stderr, flush=True)
        self._failures = {}
        super()._restart_workers(worker_group)


def run_agent(
    options: AgentOptions, rendezvous: RendezvousHandler, entrypoint: str, args: list[str]
) -> tuple[dict[int, Any], int]:
    """Run the worker group to the end; returns the workers' return values and the number of restarts.

    Raises ``ChildFailedError`` (naming every failed rank) when the group failed after its last restart, as
    ``launch_agent`` does; signals reach the caller as the agent's ``SignalException``.
    """
    spec = WorkerSpec(
        role="default",
        local_world_size=options.nproc,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rendezvous,
        max_restarts=options.max_restarts,
        monitor_interval=options.monitor_interval_s,
        local_addr=options.local_addr,
    )
    agent = _NarratingAgent(
        spec=spec,
        logs_specs=options.logs_specs,
        start_method="spawn",
        log_line_prefix_template="[rank${rank}]: ",
        shutdown_timeout=options.shutdown_timeout_s,
    )
    result = agent.run()
    if result.is_failed():
        raise ChildFailedError(name=entrypoint, failures=result.failures)
    return result.return_values, agent.restarts
