"""The hang watchdog's judgement and reports, apart from its thread (`loom.fault.watchdog`): functions of the
records every rank publishes (``current``, ``waiting_s``, ``done``, ``time``), tested without processes, and the
stack dump a waiting rank asks of one outside any collective. Under heal the quorum's members publish the same
records, numbered within their membership epoch (`loom.fault.quorum`), and `dropped_report` names who did not
arrive at a collective that timed out."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import time

__all__ = [
    "all_inside_s", "doing", "dropped_report", "hang_report", "not_arrived", "print_stacks", "stacks_asked",
    "stop_process",
]  # fmt: skip


def all_inside_s(records: dict[int, dict | None], rank: int, waited_s: float) -> float:
    """How long every rank has been inside a collective or silent, as far as ``records`` tell (see the module
    docstring): the minimum over ranks of a rank's time in its collective, or of the time since it was last heard
    from when it is outside one (a live rank's is under a few polls). A record that could not be read counts as
    forever (the rank cannot be shown to be working); this rank's own wait is ``waited_s``."""
    now, inside = time.time(), waited_s
    for r, rec in records.items():
        if r == rank or rec is None:
            continue
        age = max(0.0, now - float(rec.get("time", now)))
        waiting = rec.get("waiting_s") if rec.get("current") is not None else 0.0
        inside = min(inside, float(waiting or 0.0) + age)
    return inside


def not_arrived(op: str, seq: int, records: dict[int, dict | None]) -> tuple[list[int], list[int]]:
    """The ranks that did not arrive at collective ``(op, seq)`` and those whose record could not be read.

    A rank did not arrive if it has not entered collective ``seq`` yet, or is inside a different operation under
    that number (the ranks disagree on the order of collectives).
    """
    missing, unknown = [], [r for r, rec in sorted(records.items()) if rec is None]
    for r, rec in sorted(records.items()):
        if rec is None:
            continue
        cur, done = rec.get("current"), rec.get("done")
        entered = cur[1] if cur else (done[1] if done else 0)
        if entered < seq or (cur is not None and cur[1] == seq and cur[0] != op):
            missing.append(r)
    return missing, unknown


def _rank_lines(records: dict[int, dict | None]) -> list[str]:
    """One line per rank: its last completed operation and the one it is in (`hang_report`, `dropped_report`)."""
    lines = []
    for r, rec in sorted(records.items()):
        if rec is None:
            lines.append(f"  rank {r}: no record (not started, or the store is unreachable)")
            continue
        cur, done = rec.get("current"), rec.get("done")
        now = f"in '{cur[0]}' #{cur[1]} for {rec.get('waiting_s')} s" if cur else "not in a collective"
        last = f"'{done[0]}' #{done[1]}" if done else "none"
        age = time.time() - float(rec.get("time", time.time()))
        lines.append(f"  rank {r}: last completed {last}; {now} (published {age:.1f} s ago)")
    return lines


def hang_report(
    rank: int,
    op: str,
    seq: int,
    waited_s: float,
    records: dict[int, dict | None],
    why: str | None = None,
) -> str:
    """The report: first line a summary (what the launcher shows), then one line per rank (`not_arrived`)."""
    missing, unknown = not_arrived(op, seq, records)
    who = f"ranks {missing} did not arrive" if missing else "every rank that published arrived (a slow op?)"
    if unknown:
        who += f"; ranks {unknown} could not be read"
    if why:
        who += f"; {why}"
    lines = [
        f"loom watchdog: rank {rank} waited {waited_s:.1f} s in collective '{op}' #{seq}; {who}. "
        "HINT: every rank must issue the same collectives in the same order; raise LOOM_HANG_TIMEOUT_S "
        "if the operation is just slow."
    ]
    return "\n".join(lines + _rank_lines(records))


def dropped_report(
    rank: int,
    step: int,
    epoch: int,
    op: str,
    seq: int,
    timeout: tuple[float, str],
    records: dict[int, dict | None],
) -> str:
    """Under heal, a step dropped because collective ``(op, seq)`` of membership epoch ``epoch`` timed out
    (``timeout``: its seconds and where they come from): the members that did not arrive (`not_arrived`, on the
    members' records numbered within the epoch), then one line per member. The members re-form without waiting
    further, so this line is what is left of the watchdog's report under heal."""
    missing, unknown = not_arrived(op, seq, records)
    who = (
        f"member(s) rank {', '.join(map(str, missing))} did not arrive"
        if missing
        else "every member that published arrived (a slow collective?)"
    )
    if unknown:
        who += f"; rank(s) {unknown} could not be read"
    lines = [
        f"loom: rank {rank}: step {step} dropped: collective #{seq} of epoch {epoch} ('{op}') timed out after "
        f"{timeout[0]:g} s ({timeout[1]}); {who}. HINT: a member late for its step's collectives is re-formed "
        f"without each time; raise {timeout[1].rpartition(' ')[2]} if its work there is just slow"
    ]
    return "\n".join(lines + _rank_lines(records))


def doing(current: tuple[str, int, float] | None) -> str:
    """What a rank is doing, from its watchdog's ``current`` (``(op, seq, monotonic start)`` or None)."""
    if current is None:
        return "this rank was outside any collective"
    return (
        f"this rank waited {time.monotonic() - current[2]:.0f} s in collective '{current[0]}' #{current[1]}"
    )


def print_stacks(rank: int) -> None:
    """Print every thread's Python stack of this process to stderr (the launcher's output): other ranks wait for
    this one while it is outside any collective, and asked where it is."""
    print(
        f"loom watchdog: rank {rank} is outside any collective while other ranks wait for it; its Python "
        "stack (every thread, most recent call first):",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()


def stacks_asked(
    rank: int, op: str, seq: int, waited: float, working: list[int], timeout_s: float, work_timeout_s: float
) -> str:
    """The one line a waiting rank prints for the job when it asks the ranks outside any collective for stacks."""
    return (
        f"loom watchdog: rank {rank} has waited {waited:.0f} s in collective '{op}' #{seq} (past the hang "
        f"timeout, {timeout_s:.0f} s, LOOM_HANG_TIMEOUT_S) while rank(s) {working} are outside any collective: "
        "their own work (evaluation, a checkpoint) or stuck in it. Their Python stacks follow on their output; "
        f"the others wait for them up to the work timeout ({work_timeout_s:.0f} s, LOOM_WORK_TIMEOUT_S)."
    )


def stop_process(text: str, error: type[Exception], rank: int, poll_s: float) -> None:
    """Print ``text``, record its first line as ``error`` for the launcher (``loom run`` prints it), end the
    process with exit code 1: the main thread may be blocked inside C++ and cannot be interrupted."""
    print(text, file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error(text.splitlines()[0]))
    sys.stdout.flush()
    if rank == 0:  # rank 0 hosts the store: give the others a moment to read it before it goes
        time.sleep(poll_s)
    os._exit(1)
