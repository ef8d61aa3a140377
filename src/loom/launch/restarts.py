"""``--on-worker-failure stop`` (the default): a dead worker stops the group, which restarts as a whole up to
``--max-restarts`` times, on one node or many (user-facing: docs/launching.md).

The workers are `loom.launch.supervise`'s (forked by the zygote, output prefixed, logs in ``logs/attempt_K``).
The nodes meet in loom's authenticated store (`loom.net.store`), which node 0's launcher hosts on the master
address (loopback for one node): every peer proves the job secret, nothing is unpickled, every call is bounded.
Attempt K is a round of its own: each node writes ``roundK/nodeN`` and waits for all until ``--join-timeout``,
then starts its workers with ``TORCHELASTIC_RESTART_COUNT=K`` and their keys under ``loom/RUN/roundK/job/``, so
an attempt never reads the previous one's keys. A node whose worker fails sets ``roundK/failed``; every node then
stops its workers within ``shutdown_timeout_s`` and, while restarts are left, joins round K+1, saying so.

Liveness (docs/fault-tolerance.md, "How liveness works"): every node other than 0 bumps ``alive/nodeN`` in node
0's store each `BEAT_S`. A peer unheard for ``lost_after_s`` (``LOOM_LIVENESS_TIMEOUT_S`` plus
`LOST_AFTER_GRACE_S`, or the hang timeout if shorter) stops the job with `PeerLost` naming it: a backstop for a
worker without a watchdog, or blocked where it does not count. A node refused by the store knows node 0 ended.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time
from collections.abc import Callable

from loom.errors import GroupFailed, PeerLost
from loom.launch.spec import LaunchSpec
from loom.launch.supervise import (
    Placement,
    Worker,
    describe_exit,
    end_workers,
    exception_of,
    start_worker,
    worker_env,
)
from loom.launch.zygote import Zygote
from loom.net.store import LoomStore, StoreServer, StoreTimeout, StoreUnreachable

__all__ = ["BEAT_S", "LOST_AFTER_GRACE_S", "Rounds", "restart_line", "root_failure", "run_group"]

BEAT_S = 1.0
"""Seconds between heartbeats of a node to node 0's store."""
LOST_AFTER_GRACE_S = 5.0
"""A node's launcher declares a silent peer lost this long after the liveness timeout, so that the workers'
report (which names ranks and what they were doing) comes first when they can give one."""
TICK_S, BYE_WAIT_S = 0.1, 10.0
RESUME_NOTE = (
    "a script that checkpoints resumes from its latest checkpoint (loom.fit and hvd.elastic.run do), "
    "one that does not starts over"
)
"""Said of every script, since the launcher cannot tell whether this one uses loom.fit."""
_SETTING = f" (LOOM_LIVENESS_TIMEOUT_S + {LOST_AFTER_GRACE_S:g} s, or LOOM_HANG_TIMEOUT_S if shorter)"
_CONSEQUENCES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "connection to rank")
"""Errors a rank raises because a peer failed first."""
_STORE_ERRORS = (StoreUnreachable, StoreTimeout, OSError)


def root_failure(failures: dict[int, Worker]) -> int:
    """The rank whose failure caused the others: one killed by a signal from outside (not the launcher's SIGTERM:
    SIGKILL, the OOM killer, a crash), else one that raised an error not about a lost peer, else one that
    raised, else the lowest rank. A rank that lost a killed peer raises too, so a signal ranks first."""

    def blame(rank: int) -> tuple[int, int]:
        code, error = failures[rank].proc.returncode, exception_of(failures[rank])
        consequence = error is not None and any(text in error for text in _CONSEQUENCES)
        signalled = code < 0 and code != -15
        return (0 if signalled else 1 if error and not consequence else 2 if error else 3, rank)

    return min(failures, key=blame)


def restart_line(failures: dict[int, Worker], attempt: int, max_restarts: int) -> str:
    """The line printed when the worker group restarts into ``attempt`` (0-based): who failed and how
    (``failures`` empty: a worker on another node), the failed attempt's log folder, which attempt this is, and
    what the workers do next."""
    cause = describe_exit(failures[root_failure(failures)]) if failures else "a worker on another node failed"
    return (
        f"loom run: {cause} (logs/attempt_{attempt - 1}); restarting the worker group, attempt {attempt + 1} of "
        f"{max_restarts + 1} "
        f"(logs/attempt_{attempt}; --max-restarts {max_restarts}); {RESUME_NOTE}"
    )


class Rounds:
    """This node's place in the job's store at ``host:port`` (node 0 hosts it, made here so that a bad address
    fails before anything starts): each attempt's round, the flags every node reads, liveness."""

    def __init__(self, spec: LaunchSpec, host: str, port: int, secret: bytes, run_id: str, local_addr: str,
                 lost_after_s: float) -> None:  # fmt: skip
        self.node, self.nnodes, self.join_timeout_s = spec.node_rank, spec.nnodes, spec.join_timeout_s
        self.nproc, self.run_id = spec.nproc, run_id
        self.local_addr, self.lost_after_s = local_addr, lost_after_s
        self.server = StoreServer(host, port, secret) if self.node == 0 else None
        self.host, self.port = host, (self.server.port if self.server else port)
        self.master = f"{self.host}:{self.port}"
        self.store = LoomStore(
            host, self.port, secret, prefix=f"loom/{run_id}/", timeout=datetime.timedelta(seconds=spec.join_timeout_s),
            connect_timeout_s=spec.join_timeout_s, io_timeout_s=min(10.0, lost_after_s), server=self.server,
        )  # fmt: skip
        self.quick = self.store.with_prefix("")  # a connection of its own, with short timeouts
        self.quick.connect_timeout_s = self.quick.io_timeout_s = 2.0
        self.lost: str | None = None
        self.peers: dict[int, str] = {}
        self._heard: dict[int, float] = {}
        self._beats: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    def join(self, attempt: int) -> list[int]:
        """Join round ``attempt`` and wait for every node; returns each node's ``-n``, in node order."""
        store, keys = self.store.with_prefix(f"round{attempt}/"), [f"node{i}" for i in range(self.nnodes)]
        try:
            store.set(f"node{self.node}", f"{self.nproc} {self.local_addr}")
            self._wait_for_all(store, keys)
            found = [value.decode(errors="replace").split(" ", 1) for value in store.multi_get(keys)]
        except StoreUnreachable as error:
            raise PeerLost(
                f"node {self.node} cannot reach node 0 (the master at {self.master}): {error}. HINT: start "
                "node 0 first with the same --master, check the address and firewall, and give every node the same "
                "LOOM_JOB_SECRET; --join-timeout sets how long to wait"
            ) from None
        finally:
            store.close()
        self.peers = {i: addr for i, (_, addr) in enumerate(found)}
        if self._monitor is None and self.nnodes > 1:
            self._heard = dict.fromkeys(range(self.nnodes), time.monotonic())
            self._monitor = threading.Thread(target=self._watch, name="loom-heartbeat", daemon=True)
            self._monitor.start()
        return [int(n) for n, _ in found]

    def _wait_for_all(self, store: LoomStore, keys: list[str]) -> None:
        start, told = time.monotonic(), False
        while True:
            if self.lost:
                raise PeerLost(self.lost)
            try:
                return store.wait(keys, datetime.timedelta(seconds=1))
            except StoreTimeout:
                waited = time.monotonic() - start
            if waited >= self.join_timeout_s:
                missing = [i for i, k in enumerate(keys) if not store.check([k])]
                raise PeerLost(
                    f"node(s) {missing} did not join the job at {self.master} within {self.join_timeout_s:g} s. "
                    f"HINT: start `loom run --nnodes {self.nnodes} --node-rank N --master {self.master} ...` on "
                    "every node, with the same LOOM_JOB_SECRET; raise --join-timeout if they start later"
                )
            if waited >= 10 and not told:
                told = True
                print(f"loom run: node {self.node} waiting for the other nodes at {self.master} (up to "
                      f"{self.join_timeout_s:g} s, --join-timeout)", file=sys.stderr, flush=True)  # fmt: skip

    def flag(self, key: str) -> None:
        """Set ``key`` (bounded: a node that cannot is, or soon will be, lost)."""
        with contextlib.suppress(*_STORE_ERRORS):
            self.quick.set(key, str(self.node))

    def flagged(self, *keys: str) -> bool:
        """Whether every key in ``keys`` is set (False when node 0's store does not answer)."""
        try:
            return self.quick.check(list(keys))
        except _STORE_ERRORS:
            return False

    def close(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        for store in (self.store, self.quick):
            store.close()
        if self.server is not None:
            self.server.close()

    def _name(self, node: int) -> str:
        where = f"the master at {self.master}" if node == 0 else self.peers.get(node, "?")
        return f"node {node} ({where})"

    def silent_peers(self, min_s: float = 3 * BEAT_S) -> str | None:
        """Which peers this node has not heard from for ``min_s`` seconds, in words, or None."""
        now = time.monotonic()
        silent = [(n, now - t) for n, t in self._heard.items() if n != self.node and now - t >= min_s]
        return (
            self.lost
            or "; ".join(f"no contact with {self._name(n)} for {s:.0f} s" for n, s in silent)
            or None
        )

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S):
            now = time.monotonic()
            if self.server is None:  # another node: beat, and learn whether node 0 is still there
                try:
                    self.quick.add(f"alive/node{self.node}", 1)
                    self._heard[0] = now
                except _STORE_ERRORS as error:
                    if "connection refused" in str(error) and not self.lost:
                        self.lost = f"lost {self._name(0)}: its launcher has ended (connection refused)"
                    elif now - self._heard[0] > self.lost_after_s and not self.lost:
                        self.lost = (
                            f"lost {self._name(0)}: no answer for {now - self._heard[0]:.0f} s{_SETTING}"
                        )
                continue
            for node in range(1, self.nnodes):  # node 0: one dict read at a time, no lock needed
                beat = self.server.table.data.get(f"loom/{self.run_id}/alive/node{node}".encode())
                if beat is not None and beat != self._beats.get(node):
                    self._beats[node], self._heard[node] = beat, now
                elif now - self._heard[node] > self.lost_after_s and not self.lost:
                    self.lost = (
                        f"lost {self._name(node)}: no heartbeat for {now - self._heard[node]:.0f} s{_SETTING}"
                    )


def run_group(spec: LaunchSpec, rounds: Rounds, worker_args: list[str], zygote: Zygote,
              server_failure: Callable[[], object]) -> int:  # fmt: skip
    """Run this node's workers, attempt after attempt, until every node's succeeded (returns the number of
    restarts) or the last attempt failed, or ``server_failure()`` is not None (a parameter server died once too
    often): `GroupFailed`, its argument the restarts done; `PeerLost` when a node is lost or does not join."""
    for attempt in range(spec.max_restarts + 1):
        sizes = rounds.join(attempt)
        first, logs = sum(sizes[: spec.node_rank]), spec.run_dir / "logs" / f"attempt_{attempt}"
        logs.mkdir(parents=True, exist_ok=True)
        placement = Placement(first, sum(sizes), spec.node_rank, spec.nnodes, rounds.host)
        overrides = {
            "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "LOOM_STORE_PREFIX": f"loom/{rounds.run_id}/round{attempt}/job/", "LOOM_ON_WORKER_FAILURE": "stop",
        }  # fmt: skip
        zygote.start(worker_env(first, spec.nproc, rounds.port, rounds.run_id, logs / "zygote.error.json", "stop",
                                0, placement, overrides))  # fmt: skip
        workers: list[Worker] = []
        try:
            for rank in range(first, first + spec.nproc):
                workers.append(start_worker(rank, spec.nproc, worker_args, rounds.port, rounds.run_id, logs,
                                            "stop", 0, placement, zygote, overrides, True))  # fmt: skip
            failures = _watch(rounds, attempt, workers, server_failure)
        finally:
            end_workers(workers, spec.shutdown_timeout_s)
        if failures is None:
            return attempt
        if attempt < spec.max_restarts:
            print(restart_line(failures, attempt + 1, spec.max_restarts), file=sys.stderr, flush=True)
            continue
        _say_failed(failures, workers, rounds)
        print(f"loom run: the job failed in attempt {attempt + 1} of {attempt + 1} (logs/attempt_{attempt}); no "
              f"restart left (--max-restarts {spec.max_restarts})", file=sys.stderr)  # fmt: skip
        raise GroupFailed(attempt)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _say_failed(failures: dict[int, Worker], workers: list[Worker], rounds: Rounds) -> None:
    """One line for the root cause (`root_failure`), one for the workers stopped because of it, one for the
    peers this node lost contact with, if any."""
    lines = ["loom run: a worker on another node failed; stopped this node's workers"]
    if failures:
        root = failures[root_failure(failures)]
        lines = [f"loom run: {describe_exit(root)}"]
        others = [w.rank for w in workers if w.rank != root.rank]
        lines += [f"loom run: stopped the other workers (ranks {others})"] if others else []
    lost = rounds.silent_peers()
    print("\n".join(lines + ([f"loom run: {lost}"] if lost else [])), file=sys.stderr)


def _watch(rounds: Rounds, attempt: int, workers: list[Worker],
           server_failure: Callable[[], object]) -> dict[int, Worker] | None:  # fmt: skip
    """Watch one attempt: None when every node's workers succeeded, else the failures seen here (empty: another
    node's). Raises `PeerLost`, or `GroupFailed` when a parameter server stopped the job."""
    key, said_done = f"round{attempt}/", False
    while True:
        if server_failure() is not None:
            raise GroupFailed(attempt)
        if rounds.lost:
            raise PeerLost(rounds.lost)
        failed = {w.rank: w for w in workers if w.proc.poll() not in (None, 0)}
        if failed:
            rounds.flag(f"{key}failed")
            return failed
        if rounds.flagged(f"{key}failed"):
            return {}
        if not said_done and all(w.proc.poll() == 0 for w in workers):
            rounds.flag(f"{key}done{rounds.node}")
            said_done = True
        if said_done and rounds.flagged(*(f"{key}done{k}" for k in range(rounds.nnodes))):
            rounds.flag(f"{key}bye{rounds.node}")
            deadline = time.monotonic() + BYE_WAIT_S  # node 0's store stays up until every node read the end
            while rounds.server is not None and time.monotonic() < deadline and not rounds.lost:
                if rounds.flagged(*(f"{key}bye{k}" for k in range(rounds.nnodes))):
                    break
                time.sleep(TICK_S)
            return None
        time.sleep(TICK_S)
