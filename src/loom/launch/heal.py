"""The launcher's side of healing (``loom run --on-worker-failure heal``): the quorum's authority and the
replacements. User-facing behaviour and its tests: docs/fault-tolerance.md.

The launcher is the natural authority over membership: the workers are its children (it sees a death at once,
with its signal), and it hosts the job's store, so no worker's death takes the quorum down. Every tick
(`loom.launch.heal_nodes.TICK_S`; the protocol is `loom.fault.quorum`'s) `HealQuorum` replaces a lost worker
(`exit_kind`) with the next generation of its rank (``LOOM_HEAL_GENERATION``) while ``--max-heals`` lasts, kills a
worker whose heartbeat stops, and publishes the next epoch once every live member has checked in, or after their
work timeout (the silent ones have their stacks printed and are killed). Each worker tells its timeouts in
``guard/RANK/GEN``; heal's own ``LOOM_HEAL_*`` settings apply until it has. A script's own error, fewer members
than ``--min-workers`` or one loss past ``--max-heals`` stops the job (`JobStops`), with one line saying why.

`HealQuorum` acts through each node's agent (`loom.launch.heal_nodes`; one host is node 0 alone): ``restart`` and
``kill`` become orders, a death is an event, and a lost node's ranks are dropped (`HealQuorum.drop`), not replaced.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loom.errors import JobStops, check_int
from loom.fault.quorum_records import GUARD_KEYS, LEFT_OUT_STATUS, read_guard, read_place
from loom.settings import setting

__all__ = [
    "HealPolicy",
    "HealQuorum",
    "JobStops",
    "exit_kind",
    "main_thread_place",
    "stuck_place",
]


@dataclass(frozen=True)
class HealPolicy:
    max_heals: int = 3
    """Replacements the job may start in all; one more lost worker stops the job, naming the ranks."""
    min_workers: int = 1
    """Members below which the job stops, naming the lost ranks."""

    def __post_init__(self) -> None:
        check_int("--max-heals", self.max_heals, 0, hint="HealPolicy(max_heals=...): replacements in all")
        check_int("--min-workers", self.min_workers, hint="HealPolicy(min_workers=...): the fewest members")


def exit_kind(status: int) -> str:
    """``finished`` (0), ``lost`` (a signal, or `LEFT_OUT_STATUS`, set when the quorum tells a worker to leave:
    healed) or ``error`` (any other status: the script's own error, which a replacement would only repeat,
    spending the budget and hiding the traceback: the job stops)."""
    if status == 0:
        return "finished"
    return "lost" if status < 0 or status == LEFT_OUT_STATUS else "error"


@dataclass
class HealQuorum:
    """The quorum's state in the launcher. ``store``: a client of the job's store (the workers' prefix);
    ``restart(rank, generation)``: start a replacement process; ``alive(rank)``: the rank's current process
    runs; ``kill(rank)``: SIGKILL its current process."""

    nproc: int
    policy: HealPolicy
    store: Any
    restart: Callable[[int, int], None]
    alive: Callable[[int], bool]
    kill: Callable[[int], None]
    dump: Callable[[int], str | None] = lambda rank: None
    """Print rank ``rank``'s stacks (the launcher's output shows them) and return where its main thread is (one
    line), or None where that cannot be had (`stuck_place`)."""
    generation: dict[int, int] = field(default_factory=dict)
    epoch: int = 0
    members: dict[int, int] = field(default_factory=dict)
    """Rank -> the generation of its process in the current epoch."""
    heals: int = 0
    lost: list[str] = field(default_factory=list)
    _pending: bool = False
    _reform_deadline: float | None = None
    _beats: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)
    _finished: set[int] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)
    """Ranks lost for good, never replaced nor waited for (their node is gone: `drop`)."""
    stuck: dict[tuple[int, str], int] = field(default_factory=dict)
    """(rank, where its main thread was) -> how many of its processes were killed there for not checking in."""
    _guards: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)
    """(rank, generation) -> the timeouts that process told (`read_guard`), once it has."""

    def __post_init__(self) -> None:
        self.generation = {r: 0 for r in range(self.nproc)}
        self.heartbeat_timeout_s: float = setting("LOOM_HEAL_HEARTBEAT_TIMEOUT_S")
        self.checkin_timeout_s: float = setting("LOOM_HEAL_CHECKIN_TIMEOUT_S")
        self.stuck_repeats = int(setting("LOOM_HEAL_STUCK_REPEATS"))

    @property
    def ending(self) -> bool:
        """A worker finished its training: no new epoch is formed (a replacement still waiting is not needed)."""
        return bool(self._finished)

    def is_member(self, rank: int) -> bool:
        """Whether rank ``rank``'s current process belongs to the current epoch."""
        return self.members.get(rank) == self.generation[rank]

    # -- events -------------------------------------------------------------------------------------------------
    def finished(self, rank: int) -> None:
        """Rank ``rank`` finished its training (exited 0): no epoch forms again. ``q/end`` tells a member still
        waiting for one (its loop wants more steps than this one's) to stop at once (`loom.fault.quorum.JobEnded`)
        instead of at its epoch timeout (120 s)."""
        if not self._finished:
            self.store.set("q/end", str(rank))
        self._finished.add(rank)

    def ended(self, rank: int, status: int, what: str) -> None:
        """Rank ``rank``'s current process ended with ``status`` (``what`` says how, as one line): a finished
        worker, a lost one (replaced) or the script's own error (`JobStops`), as `exit_kind` says."""
        kind = exit_kind(status)
        if kind == "finished":
            self.finished(rank)
        elif kind == "lost":
            self.died(rank, what)
        else:
            raise JobStops(f"{what}; the script's own error is not healed (a replacement would repeat it): the job "
                           "stops. HINT: fix the error; a worker killed by a signal is healed")  # fmt: skip

    def drop(self, rank: int, what: str, grace_s: float = 0.0) -> None:
        """Rank ``rank`` is lost with no way to replace it (its node is gone, `loom.launch.heal_nodes`): its epoch
        is marked and it is never waited for again. A member of the epoch gives the others ``grace_s`` more to
        check in: a survivor in a collective with a partitioned peer learns of it only at its group's timeout
        (no connection resets across a cut link), and must not be killed for that."""
        self.lost.append(what)
        self.gone.add(rank)
        if self.is_member(rank):
            self.store.set(f"q/{self.epoch}/dead", str(rank))
            deadline = time.monotonic() + self.checkin_timeout_s + grace_s
            self._reform_deadline = max(self._reform_deadline or 0.0, deadline)

    def died(self, rank: int, what: str) -> None:
        """Rank ``rank``'s process ended badly (``what`` says how): mark its epoch, replace it or stop."""
        self.lost.append(what)
        if self.is_member(rank):
            self.store.set(f"q/{self.epoch}/dead", str(rank))
        if self._finished:
            print(f"loom run: {what}; the others have finished: no replacement", file=sys.stderr, flush=True)
            return
        if self.heals >= self.policy.max_heals:
            raise JobStops(f"{what}; past --max-heals {self.policy.max_heals}: the job stops (lost: "
                           f"{'; '.join(self.lost)})")  # fmt: skip
        self.heals += 1
        self.generation[rank] += 1
        print(f"loom run: {what}; starting its replacement (heal {self.heals} of {self.policy.max_heals}, "
              f"generation {self.generation[rank]}); the others go on", file=sys.stderr, flush=True)  # fmt: skip
        self.restart(rank, self.generation[rank])
        self._mark_joining()

    # -- the tick -----------------------------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        self._check_heartbeats(now)
        ready = self._ready()
        if self.epoch == 0:
            if ready and len(ready) == self.nproc - len(self.gone):
                self._publish(sorted(ready))
            return
        if self._finished:
            return  # a member finished: the job is ending, no new epoch (a waiting replacement is stopped)
        joiners = [r for r in ready if self.members.get(r) != self.generation[r]]
        if joiners and not self._pending:
            self._pending = True
            self.store.set(f"q/{self.epoch}/pending", "1")
        live = [r for r, g in self.members.items() if g == self.generation[r] and self.alive(r)]
        checked = [r for r in live if self.store.check([f"q/{self.epoch}/in/{r}"])]
        lost = len(live) < len(self.members)
        if not checked and not lost:
            return
        if self._reform_deadline is None:
            self._reform_deadline = now + max(self._timeout(r, "work_s")[0] for r in live or [0])
        if len(checked) < len(live) and now < self._reform_deadline:
            return
        for r in sorted(set(live) - set(checked)):
            place = self.dump(r)  # before the kill: a deterministic hang must not be healed without a clue
            waited, name = self._timeout(r, "work_s")
            print(f"loom run: worker rank {r} did not check in within {waited:g} s ({name})"
                  f"{f', stuck at {place}' if place else ''}{self._where(r)}: dropped and killed", file=sys.stderr,
                  flush=True)  # fmt: skip
            self.kill(r)
            self._count_stuck(r, place)
        new = sorted(set(checked) | set(joiners))
        if len(new) < self.policy.min_workers:
            raise JobStops(f"{len(new)} worker(s) left, below --min-workers {self.policy.min_workers} (lost: "
                           f"{'; '.join(self.lost) or 'none'})")  # fmt: skip
        if not new:
            return  # every member lost: the replacements will form the next epoch when ready
        self._publish(new)

    def _where(self, rank: int) -> str:
        """Where rank ``rank``'s member was among the current epoch's collectives, as its heartbeat last said
        (``at/RANK``, `loom.fault.quorum.Quorum.place`), for the line that drops it; "" when it never said."""
        key = f"at/{rank}"
        told = self.store.get(key) if self.store.check([key]) else None
        place = None if told is None else read_place(told, self.epoch, self.generation[rank])
        if place is None:
            return ""
        if place["current"]:
            return (
                f", inside collective #{place['current'][1]} ('{place['current'][0]}') of epoch {self.epoch}"
            )
        done = place["done"]
        after = f" after #{done[1]} ('{done[0]}')" if done else " (none yet)"
        return f", outside the collectives of epoch {self.epoch}{after}"

    def _count_stuck(self, rank: int, place: str | None) -> None:
        """Stop the job when rank ``rank`` was stuck at ``place`` `stuck_repeats` times: a replacement would stop
        there again, and healing it would spend the budget with no clue but this."""
        if place is None:
            return
        seen = self.stuck[(rank, place)] = self.stuck.get((rank, place), 0) + 1
        if seen >= self.stuck_repeats:
            raise JobStops(f"worker rank {rank} was stuck at the same place {seen} times ({place}; its stacks are "
                           "above): a replacement would stop there again, so the job stops instead of healing. "
                           "HINT: fix what hangs there; LOOM_HEAL_STUCK_REPEATS sets how many times a rank may")  # fmt: skip

    def _publish(self, ranks: list[int]) -> None:
        if self.epoch and not any(self.members.get(r) == self.generation[r] for r in ranks):
            print(f"loom run: WARNING: none of the members of epoch {self.epoch + 1} {ranks} was a member of epoch "
                  f"{self.epoch}: every process that held the job's trained state was lost, so the job goes on from "
                  "what its new processes load (the script's start, or its checkpoint): the steps trained since "
                  "are trained again", file=sys.stderr, flush=True)  # fmt: skip
        self.epoch += 1
        self.members = {r: self.generation[r] for r in ranks}
        self._pending, self._reform_deadline = False, None
        self.store.set(f"q/{self.epoch}/members", ",".join(f"{r}:{self.generation[r]}" for r in ranks))
        self.store.set("q/latest", str(self.epoch))
        self._mark_joining()

    def _mark_joining(self) -> None:
        """``q/E/joining``: a replacement of this epoch's time is starting (alive, not yet a member), so the members
        may wait a moment for it to be ready before their next step (`loom.fault.quorum.Quorum.wait_for_joiner`)."""
        if self.epoch and any(
            self.members.get(r) != g and r not in self.gone and self.alive(r)
            for r, g in self.generation.items()
        ):
            self.store.set(f"q/{self.epoch}/joining", "1")

    def _ready(self) -> list[int]:
        """Ranks whose current process announced it is ready to join (``ready/RANK`` = its generation)."""
        out = []
        for r in range(self.nproc):
            key = f"ready/{r}"
            fresh = r not in self._finished and self.store.check([key]) and self.alive(r)
            if fresh and int(self.store.get(key)) == self.generation[r]:
                out.append(r)
        return out

    def _check_heartbeats(self, now: float) -> None:
        for r in range(self.nproc):
            key = (r, self.generation[r])
            name = f"hb/{r}/{self.generation[r]}"
            if r in self._finished or not self.alive(r) or not self.store.check([name]):
                continue
            if self.store.check([f"bye/{r}/{self.generation[r]}"]):
                continue  # ending: its heartbeats stopped on purpose
            count = int(self.store.get(name))
            if key not in self._beats:  # a new process of this rank: its predecessors' entries go (no growth)
                self._beats = {k: v for k, v in self._beats.items() if k[0] != r}
            seen = self._beats.get(key)
            limit, name = self._timeout(r, "liveness_s")
            if seen is None or seen[0] != count:
                self._beats[key] = (count, now)
            elif now - seen[1] > limit:
                print(f"loom run: worker rank {r} sent no heartbeat for {limit:g} s ({name}): dropped and killed",
                      file=sys.stderr, flush=True)  # fmt: skip
                self.kill(r)
                self._beats.pop(key)

    def _timeout(self, rank: int, which: str) -> tuple[float, str]:
        """Rank ``rank``'s current process's ``which`` timeout (``work_s``: its check-in, ``liveness_s``: its
        heartbeat) and the name of where it comes from: what the process told (``guard/RANK/GEN``), else heal's
        own setting. Read until the process has told it; a predecessor's entry goes (no growth)."""
        key = (rank, self.generation[rank])
        if key not in self._guards:
            name = f"guard/{rank}/{key[1]}"
            guard = read_guard(self.store.get(name)) if self.store.check([name]) else None
            # a process tells before it joins: a member that has not told never will
            if guard is not None or self.members.get(rank) == key[1]:
                self._guards = {k: v for k, v in self._guards.items() if k[0] != rank}
                self._guards[key] = guard or {}
        told = self._guards.get(key, {}).get(which)
        if told is not None:
            return told, GUARD_KEYS[which]
        if which == "work_s":
            return self.checkin_timeout_s, "LOOM_HEAL_CHECKIN_TIMEOUT_S"
        return self.heartbeat_timeout_s, "LOOM_HEAL_HEARTBEAT_TIMEOUT_S"


def stuck_place(pid: int, tail: Any, wait_s: float = 3.0) -> str | None:
    """Ask process ``pid`` (a healing worker: `loom.fault.quorum.STACK_SIGNAL`) to print its stacks, wait up to
    ``wait_s`` for them in ``tail`` (its last stderr lines, a deque the launcher's pump fills), and return the
    innermost frame of its main thread (the one running `loom.launch.worker`): ``File "...", line N in f``.
    None when the process is gone or printed nothing in time."""
    from loom.fault.quorum import STACK_SIGNAL

    mark = len(tail)
    try:
        os.kill(pid, STACK_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return None
    deadline, quiet_since, seen = time.monotonic() + wait_s, time.monotonic(), -1
    while time.monotonic() < deadline:  # until its stacks are out and the stream has been quiet a moment
        lines = list(tail)[mark:] if len(tail) >= mark else list(tail)
        if len(lines) != seen:
            seen, quiet_since = len(lines), time.monotonic()
        elif any("most recent call first" in line for line in lines) and time.monotonic() - quiet_since > 0.3:
            break
        time.sleep(0.05)
    return main_thread_place(list(tail)[mark:])


def main_thread_place(lines: list[str]) -> str | None:
    """The innermost frame of the main thread in `faulthandler`'s dump ``lines`` (the thread whose frames pass
    through `loom.launch.worker`), or None."""
    blocks: list[list[str]] = []
    for line in lines:
        if "most recent call first" in line:
            blocks.append([])
        elif blocks and line.strip().startswith("File "):
            blocks[-1].append(line.strip())
    return next((frames[0] for frames in blocks if any("loom/launch/worker.py" in f for f in frames)), None)
