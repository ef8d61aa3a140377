"""The worker's side of healing (``loom run --on-worker-failure heal``): membership epochs and the commit vote.

After torchft's Manager (a quorum, a per-step ``should_commit``, recovery from a live peer), with the launcher as
the quorum's authority (`loom.launch.heal`): it sees every worker die and hosts the job's authenticated store.
User-facing account and the timeouts' table: docs/fault-tolerance.md, "--on-worker-failure heal". The store's keys:

- ``q/E/members`` (``"0:0,2:1"``: rank:generation, immutable once written) and ``q/latest``: membership epoch E,
  published by the launcher. Each epoch gets a fresh gloo group on ``q/E/pg/`` (the default WORLD group cannot
  shrink, so nothing in a heal-mode step uses it).
- ``q/E/in/RANK`` = its committed step: a member checks in for E+1 (`Quorum.reform`). The launcher waits for every
  live member of E (the silent ones are killed and replaced), adds the ready replacements and publishes E+1; a
  member left out raises `LeftOutOfQuorum`. Everyone who checks in for E asks for the same E+1, so every member
  adopts the same epoch at the same step.
- ``q/E/sS/ok`` and ``q/E/sS/verdict``: the commit vote (`Quorum.vote`). The last yes, the first no, or the first
  member to see the launcher's ``q/E/dead`` mark sets the one verdict with the store's compare-and-set, so every
  member applies the step or none does; a member waits ``vote_timeout_s`` at most, then votes no.
- ``hb/RANK/GEN`` and ``at/RANK``: the heartbeat and the member's place among its epoch's collectives, sent by the
  guard's watchdog thread (`Quorum.beat`) and judged by the launcher, not by peers on a ring (the members change).

Every store call is bounded (the store's own timeouts); every wait here has a stated deadline.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import json
import os
import signal
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from loom.comm.links import forget_links
from loom.errors import EpochNotFormed, JobEnded, LeftOutOfQuorum, StepDropped
from loom.fault.hang_report import dropped_report
from loom.fault.inject import planned
from loom.fault.quorum_records import GUARD_KEYS, HEARTBEAT_S, LEFT_OUT_STATUS, read_guard, read_place
from loom.settings import setting

__all__ = [
    "GUARD_KEYS", "HEARTBEAT_S", "LEFT_OUT_STATUS", "STACK_SIGNAL", "JobEnded", "LeftOutOfQuorum", "Quorum",
    "StepDropped", "gloo_group", "read_guard", "read_place",
]  # fmt: skip

STACK_SIGNAL = signal.SIGUSR1
"""A healing worker prints every thread's Python stack on this signal (`faulthandler`, which works while the main
thread is stuck, in C code too)."""
MIN_LIVENESS_S = 4 * HEARTBEAT_S
"""The shortest liveness timeout under heal: a few heartbeats, so that a busy host does not get a live member
killed."""


def gloo_group(store: dist.Store, index: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of ``size`` members on ``store`` (not registered with torch.distributed, so any number of
    epochs' groups can be built in one process), this process's member ``index``."""
    group = dist.ProcessGroup(store, index, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, index, size, datetime.timedelta(seconds=timeout_s))
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


class Quorum:
    """This worker's membership in a healing job (see the module docstring)."""

    def __init__(self, store: Any, rank: int, generation: int) -> None:
        self.store, self.rank, self.generation = store, rank, generation
        self.group_timeout_s = setting("LOOM_HEAL_GROUP_TIMEOUT_S")
        """Bound on each collective of an epoch's group (a frozen member is killed by the launcher sooner)."""
        self.group_timeout_name = "LOOM_HEAL_GROUP_TIMEOUT_S"
        self.vote_timeout_s = setting("LOOM_HEAL_VOTE_TIMEOUT_S")
        self.epoch_timeout_s = setting("LOOM_HEAL_EPOCH_TIMEOUT_S")
        self.join_wait_s = setting("LOOM_HEAL_JOIN_WAIT_S")
        self.epoch = 0
        self.committed = 0
        """The highest step a vote of this member's committed (an error after it must not retry that step)."""
        self.checked_in = -1
        """The committed step this member checked in with last (-1: a new worker that has none yet)."""
        self.members: list[int] = []
        self.generations: dict[int, int] = {}
        """Rank -> the heal generation of its process in the current epoch."""
        self.group: dist.ProcessGroup | None = None
        self._counter: Any = None
        """The guard's watchdog, which counts this member's collectives (`count_with`)."""
        self._base = (0, 0)
        """(epoch, the counter's number of the collective before the epoch's first): one tuple, read whole."""
        self._inside: tuple[str, int, float, float] | None = None
        """The last collective the heartbeat saw this member in: (op, number, start, when seen inside last)."""
        self._fault = planned()
        """`loom.fault.inject.fault_point` when a test plans a fault for this process (phase ``form``), else None."""
        self._listed = 0
        """How many epochs this process has been listed in (the ``form`` fault's step)."""
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def from_env(cls, store: Any) -> Quorum:
        """This worker's membership under ``loom run --on-worker-failure heal``; from here on `STACK_SIGNAL`
        prints every thread's stack (the launcher sends it before it kills a member that did not check in)."""
        faulthandler.register(STACK_SIGNAL, all_threads=True)
        atexit.register(faulthandler.unregister, STACK_SIGNAL)
        return cls(store, int(os.environ["RANK"]), int(os.environ.get("LOOM_HEAL_GENERATION", "0") or 0))

    def apply_guard(self, hang_s: float | None, work_s: float | None, liveness_s: float | None) -> None:
        """The guard's timeouts under heal, each None where the user set none (heal's ``LOOM_HEAL_*_TIMEOUT_S``
        apply then); what each bounds there: docs/fault-tolerance.md, "The guard's timeouts under heal". Called
        before `join`, so that the launcher reads them (``guard/RANK/GEN``) before it judges this process."""
        if liveness_s is not None and liveness_s < MIN_LIVENESS_S:
            raise ValueError(
                f"rank {self.rank}: liveness_timeout_s={liveness_s:g} under --on-worker-failure heal: a member's "
                f"heartbeat comes every {HEARTBEAT_S:g} s, so a live member could be killed. HINT: use at least "
                f"{MIN_LIVENESS_S:g} s"
            )
        if hang_s is not None:
            self.group_timeout_s, self.group_timeout_name = hang_s, "hang_timeout_s / LOOM_HANG_TIMEOUT_S"
        told = {k: v for k, v in {"work_s": work_s, "liveness_s": liveness_s}.items() if v is not None}
        if told:
            self.store.set(f"guard/{self.rank}/{self.generation}", json.dumps(told))

    # -- membership ---------------------------------------------------------------------------------------------
    @property
    def index(self) -> int:
        """This worker's place among the epoch's members (its share of each global batch)."""
        return self.members.index(self.rank)

    @property
    def size(self) -> int:
        return len(self.members)

    def join(self) -> None:
        """A new worker (first start or replacement): announce it is ready, then wait for an epoch with it."""
        self.store.set(f"ready/{self.rank}", str(self.generation))
        latest = int(self.store.get("q/latest")) if self.store.check(["q/latest"]) else 1
        self._wait_epoch(max(latest, 1), joining=True)  # the latest may have been formed with us already

    def reform(self, committed_step: int) -> None:
        """Ask for the next epoch (checking in with ``committed_step``) and wait until it is formed; first, if
        the step was dropped because a collective timed out, name who did not arrive (`_name_the_absent`)."""
        self._name_the_absent(committed_step + 1)
        self._abandon_group()
        self.checked_in = committed_step
        self.store.set(f"q/{self.epoch}/in/{self.rank}", str(committed_step))
        self._wait_epoch(self.epoch + 1, joining=False)

    def _wait_epoch(self, epoch: int, joining: bool) -> None:
        deadline = time.monotonic() + self.epoch_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"rank {self.rank}: no membership epoch {epoch} within {self.epoch_timeout_s:.0f} s "
                    "(LOOM_HEAL_EPOCH_TIMEOUT_S): the launcher's quorum did not answer"
                )
            key = f"q/{epoch}/members"
            try:
                self.store.wait([key], datetime.timedelta(seconds=min(left, 0.5)))
            except Exception:  # the store's own timeout: look again until our deadline
                if not joining and self.store.check(["q/end"]):  # (a joiner is stopped by the launcher)
                    self._job_ended()
                continue
            listed = [tuple(map(int, m.split(":"))) for m in self.store.get(key).decode().split(",") if m]
            if (self.rank, self.generation) in listed:
                break
            if not joining:
                raise LeftOutOfQuorum(
                    f"rank {self.rank}: left out of membership epoch {epoch} (members {[r for r, _ in listed]}): it "
                    "did not check in within the launcher's LOOM_HEAL_CHECKIN_TIMEOUT_S"
                )
            epoch += 1  # a joiner that came too late for this epoch waits for the next
        self._formed(epoch, listed)
        self._listed += 1
        if self._fault is not None:
            self._fault(self._listed, "form")
        self._meet(epoch)
        prefix = dist.PrefixStore(f"q/{epoch}/pg/", self.store)
        self.group = gloo_group(prefix, self.index, self.size, self.group_timeout_s)

    def _meet(self, epoch: int) -> None:
        """Before epoch ``epoch``'s group is built: say this member is here (``q/E/here/RANK``) and wait until
        every listed member has, up to the group's timeout. gloo's own rendezvous would wait for a member lost as
        the epoch formed, looking at nothing else, until the launcher killed every holder of the job's state as
        silent; here that loss (``q/E/dead``) or another member's check-in is seen within a poll, and
        `EpochNotFormed` makes the members check in again."""
        self.store.set(f"q/{epoch}/here/{self.rank}", str(self.generation))
        keys = [f"q/{epoch}/here/{r}" for r in self.members]
        deadline = time.monotonic() + self.group_timeout_s
        while True:
            # the store's own timeout (a lost store fails the check below)
            with contextlib.suppress(Exception):
                self.store.wait(keys, datetime.timedelta(seconds=0.2))
                return
            if self.store.check([f"q/{epoch}/dead"]):
                raise EpochNotFormed(f"rank {self.rank}: a member of epoch {epoch} was lost while it formed")
            if any(self.store.check([f"q/{epoch}/in/{r}"]) for r in self.members if r != self.rank):
                raise EpochNotFormed(f"rank {self.rank}: another member of epoch {epoch} gave up forming it")
            if time.monotonic() > deadline:
                absent = [r for r in self.members if not self.store.check([f"q/{epoch}/here/{r}"])]
                raise EpochNotFormed(
                    f"rank {self.rank}: member(s) {absent} of epoch {epoch} did not arrive to form it within "
                    f"{self.group_timeout_s:g} s ({self.group_timeout_name})"
                )

    def _formed(self, epoch: int, listed: list[tuple[int, ...]]) -> None:
        """Epoch ``epoch`` of the members ``listed`` (rank, generation) is this member's; its collectives are
        numbered from the next one the counter counts (`count_with`)."""
        self.epoch, self.members = epoch, [r for r, _ in listed]
        self.generations = {r: g for r, g in listed}
        self._base, self._inside = (epoch, self._counter.seq if self._counter is not None else 0), None

    def _job_ended(self) -> None:
        finished = self.store.get("q/end").decode()
        raise JobEnded(
            f"rank {self.rank}: rank {finished} finished the job (exited 0) while this process waited to train step "
            f"{self.checked_in + 1}: "
            "its loop runs more steps than the other members'. Under --on-worker-failure heal a replacement "
            "starts at the job's committed step (its job.loader there), not at step 0. HINT: count an own loop "
            "from the job's position (`for epoch in range(loader.epoch, EPOCHS)`, or `while job.step < STEPS`) "
            "or train with loom.fit(job, loader, epochs=...), which does"
        ) from None

    def wait_for_joiner(self) -> None:
        """Before a step: while the launcher has a replacement starting (``q/E/joining``) that is not ready yet
        (no ``q/E/pending``), wait up to ``LOOM_HEAL_JOIN_WAIT_S`` for it, so that the members train with it from
        the next step instead of short-handed. One store check per step when nothing is starting."""
        if self.join_wait_s <= 0 or not self.store.check([f"q/{self.epoch}/joining"]):
            return
        deadline = time.monotonic() + self.join_wait_s
        while time.monotonic() < deadline and not self.store.check([f"q/{self.epoch}/pending"]):
            if self.store.check([f"q/{self.epoch}/dead"]) or self.store.check(["q/end"]):
                return
            time.sleep(0.005)

    def join_pending(self) -> bool:
        """Whether the launcher has a replacement ready to join (it marks ``q/E/pending``): the members then
        re-form after the step they are committing (they agree on it through the step's all-reduce)."""
        return bool(self.store.check([f"q/{self.epoch}/pending"]))

    # -- the commit vote ----------------------------------------------------------------------------------------
    def vote(self, step: int, ok: bool) -> bool:
        """This member's vote on step ``step`` of the current epoch; returns the one verdict (True: commit)."""
        if verdict := self._vote(step, ok):
            self.committed = max(self.committed, step)
        return verdict

    def _vote(self, step: int, ok: bool) -> bool:
        key = f"q/{self.epoch}/s{step}/"
        verdict_key = key + "verdict"
        if not ok or self.store.add(key + "ok", 1) == self.size:  # a no, or the last yes: set the verdict
            return self.store.compare_set(verdict_key, "", "commit" if ok else "drop") == b"commit"
        deadline = time.monotonic() + self.vote_timeout_s
        dead_key = f"q/{self.epoch}/dead"
        while True:
            if self.store.check([verdict_key]):
                return self.store.get(verdict_key) == b"commit"
            if self.store.check([dead_key]) or time.monotonic() > deadline:
                return self.store.compare_set(verdict_key, "", "drop") == b"commit"
            time.sleep(0.002)

    # -- heartbeats and who did not arrive -----------------------------------------------------------------------
    def count_with(self, counter: Any) -> None:
        """Publish this member's place among its epoch's collectives as ``counter`` counts them (the guard's
        watchdog: ``seq``, ``current``, ``last_done``; under heal its thread sends `beat`): from
        now on each heartbeat carries it, and a collective that times out is reported (`_name_the_absent`)."""
        self._counter = counter
        self._base = (self.epoch, counter.seq)

    def place(self) -> dict[str, Any] | None:
        """This member's watchdog record numbered within its epoch (`loom.fault.hang_report`'s fields, with the
        epoch and this process's generation), or None before `count_with`. Called by each heartbeat (`beat`),
        which notes here the collective it sees this member in (for `_name_the_absent`)."""
        counter = self._counter
        if counter is None:
            return None
        (epoch, base), current = self._base, counter.current
        if current is not None and current[1] > base:
            inside = self._inside
            start = inside[2] if inside is not None and inside[1] == current[1] else current[2]
            self._inside = (current[0], current[1], start, time.monotonic())
        return {"gen": self.generation, "epoch": epoch, **counter.place(base)}

    def _name_the_absent(self, step: int) -> None:
        """If this member's last collective was seen inside for about the epoch group's timeout (it timed out:
        the heartbeat samples every `HEARTBEAT_S`), print which members had not arrived at it (their ``at/RANK``),
        its number in the epoch, its operation and ``step``. Store reads only then, each bounded."""
        counter, inside, (epoch, base) = self._counter, self._inside, self._base
        self._inside = None
        if counter is None or inside is None or inside[1] != counter.seq or epoch != self.epoch:
            return
        if inside[3] - inside[2] < max(self.group_timeout_s - 2 * HEARTBEAT_S, self.group_timeout_s / 2):
            return  # failed sooner: a lost member's closed connection, an error named by the step's own line
        records: dict[int, dict | None] = {}
        for r in (r for r in self.members if r != self.rank):
            try:
                raw = self.store.get(f"at/{r}") if self.store.check([f"at/{r}"]) else None
            except Exception:  # the store's own timeout: that member's record could not be read
                raw = None
            records[r] = None if raw is None else read_place(raw, epoch, self.generations.get(r, -1))
        timeout = (self.group_timeout_s, self.group_timeout_name)
        report = dropped_report(self.rank, step, epoch, inside[0], inside[1] - base, timeout, records)
        print(report, file=sys.stderr, flush=True)

    def beat(self, store: Any) -> None:
        """One heartbeat on ``store`` (the watchdog thread's connection: `loom.fault.watchdog.Watchdog.start`):
        ``hb/RANK/GEN`` counts, and ``at/RANK`` says this member's place (`place`)."""
        store.add(f"hb/{self.rank}/{self.generation}", 1)
        place = self.place()
        if place is not None:
            store.set(f"at/{self.rank}", json.dumps(place))

    def _abandon_group(self) -> None:
        """Close this epoch's group, so that a member still waiting in one of its collectives fails at once, not
        at the group's timeout (past the launcher's check-in timeout: it would be killed). gloo's ``abort()``
        closes nothing; the connections close when nothing holds the group: the caller must not hold it (e.g. in
        an exception's traceback), and a group kept alive by reference cycles is collected (costly: only then)."""
        if self.group is not None:
            forget_links(self.group)  # a ring's links (``allreduce="ring"`` under heal) hold the group too
            alive = weakref.ref(self.group)
            self.group = None
            if alive() is not None:
                gc.collect()

    def close(self) -> None:
        """Leave: the last epoch's group closed, and ``bye/RANK/GEN`` tells the launcher that the heartbeats stop
        because the process is ending (its exit may take a while), not because it froze. At exit too."""
        if self._closed:
            return
        self._closed = True
        self._abandon_group()
        with contextlib.suppress(Exception):
            self.store.set(f"bye/{self.rank}/{self.generation}", "1")
