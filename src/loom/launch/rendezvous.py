"""loom's rendezvous for the elastic agent: a fixed set of nodes meeting in loom's authenticated store.

Not the agent's ``c10d`` rendezvous, which keeps its state as a pickle in a ``TCPStore`` that accepts anyone and
unpickles it (remote code execution in every launcher), nor ``static`` (the same ``TCPStore``). loom's jobs have a
fixed size, so a static rendezvous is enough, held in `loom.net.store` (node 0's launcher hosts it on the master
address, loopback for one node): every peer proves the job secret, nothing is unpickled, every call is bounded.

Each ``next_rendezvous`` (first start, each group restart) is a new round with its own key prefix, so a restart
never reads the previous attempt's keys; the workers' keys go under ``LOOM_STORE_PREFIX`` (read by `loom.init`). A
node waits for all ``nnodes`` until ``join_timeout_s``, then names the missing ones. A restarting node joins the
next round first; the others see it waiting (`num_nodes_waiting`) and restart their workers too, as with ``c10d``.

Liveness (docs/fault-tolerance.md, "How liveness works"): every node other than 0 bumps a heartbeat key in node 0's
store each `BEAT_S`. A peer unheard for ``lost_after_s`` (``LOOM_LIVENESS_TIMEOUT_S`` plus `LOST_AFTER_GRACE_S`,
or the hang timeout if shorter) makes the agent's next call raise `PeerLost` naming it: a backstop for a worker
without a watchdog, or blocked where it does not count. A node whose store connection is refused after it joined
knows node 0's launcher has ended, and stops at once.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

from loom.errors import PeerLost
from loom.net.store import LoomStore, StoreServer, StoreTimeout, StoreUnreachable

if TYPE_CHECKING:
    from loom.launch.spec import LaunchSpec

__all__ = ["BEAT_S", "LOST_AFTER_GRACE_S", "LoomRendezvous", "PeerLost"]

BEAT_S = 1.0
"""Seconds between heartbeats of a node to node 0's store."""
LOST_AFTER_GRACE_S = 5.0
"""A node's launcher declares a silent peer lost this long after the liveness timeout, so that the workers'
report (which names ranks and what they were doing) comes first when they can give one."""


_SETTING = f" (LOOM_LIVENESS_TIMEOUT_S + {LOST_AFTER_GRACE_S:g} s, or LOOM_HANG_TIMEOUT_S if shorter)"


class LoomRendezvous(RendezvousHandler):
    """The rendezvous of ``spec``'s node (its ``node_rank`` of ``nnodes``, each waiting ``join_timeout_s`` for the
    others) at ``host:port`` (node 0 hosts the store there).

    Node 0 makes the `StoreServer` in the constructor, so a bad address fails before anything starts."""

    def __init__(
        self,
        spec: LaunchSpec,
        host: str,
        port: int,
        secret: bytes,
        run_id: str,
        local_addr: str,
        lost_after_s: float,
    ) -> None:
        self.node_rank, self.nnodes, self.join_timeout_s = spec.node_rank, spec.nnodes, spec.join_timeout_s
        self.run_id, self.local_addr, self.lost_after_s = run_id, local_addr, lost_after_s
        self.server = StoreServer(host, port, secret) if self.node_rank == 0 else None
        self.host, self.port = host, (self.server.port if self.server else port)
        self.master = f"{self.host}:{self.port}"
        timeout = datetime.timedelta(seconds=self.join_timeout_s)
        self.store = LoomStore(
            host, self.port, secret, prefix=f"loom/{run_id}/", timeout=timeout,
            connect_timeout_s=self.join_timeout_s, io_timeout_s=min(10.0, lost_after_s), server=self.server,
        )  # fmt: skip
        self._beat_store = self.store.with_prefix("")  # a connection of its own, with short timeouts
        self._beat_store.connect_timeout_s = self._beat_store.io_timeout_s = 2.0
        self._beats: dict[int, bytes] = {}
        self._round = 0
        self._waiting = 0
        self._lost: str | None = None
        self._peers: dict[int, str] = {}
        self._heard: dict[int, float] = {}
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # -- the RendezvousHandler interface ---------------------------------------------------------------
    def get_backend(self) -> str:
        return "loom"

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers join the launchers' store (node 0 hosts it): a dead worker 0 takes nothing

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        if self._lost:
            raise PeerLost(self._lost)
        return self._waiting

    def next_rendezvous(self) -> RendezvousInfo:
        if self._lost:
            raise PeerLost(self._lost)
        r = self._round
        self._round, self._waiting = r + 1, 0
        store = self.store.with_prefix(f"round{r}/")
        try:
            store.add("joined", 1)
            store.set(f"node{self.node_rank}", self.local_addr)
            self._wait_for_all(store)
            addrs = store.multi_get([f"node{i}" for i in range(self.nnodes)])
        except StoreUnreachable as error:
            raise PeerLost(
                f"node {self.node_rank} cannot reach node 0 (the master at {self.master}): {error}. HINT: start "
                "node 0 first with the same --master, check the address and firewall, and give every node the same "
                "LOOM_JOB_SECRET; --join-timeout sets how long to wait"
            ) from None
        self._peers = {i: a.decode(errors="replace") for i, a in enumerate(addrs)}
        if self._monitor is None and self.nnodes > 1:
            now = time.monotonic()
            self._heard = {i: now for i in range(self.nnodes)}
            self._monitor = threading.Thread(target=self._watch, name="loom-rdzv-heartbeat", daemon=True)
            self._monitor.start()
        # Read by the workers' `loom.init` (the agent copies this environment into each worker it starts).
        os.environ["LOOM_STORE_PREFIX"] = f"loom/{self.run_id}/round{r}/job/"
        return RendezvousInfo(store, self.node_rank, self.nnodes, RendezvousStoreInfo(self.host, self.port))

    def shutdown(self) -> bool:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        if self.server is None:
            with contextlib.suppress(StoreUnreachable, StoreTimeout):
                self._beat_store.set(f"alive/left{self.node_rank}", "1")
        for store in (self.store, self._beat_store):
            store.close()
        if self.server is not None:
            self.server.close()
        return True

    # -- joining, liveness -----------------------------------------------------------------------------
    def _wait_for_all(self, store: LoomStore) -> None:
        keys = [f"node{i}" for i in range(self.nnodes)]
        start = time.monotonic()
        told = False
        while True:
            if self._lost:
                raise PeerLost(self._lost)
            try:
                store.wait(keys, datetime.timedelta(seconds=1))
                return
            except StoreTimeout:
                pass
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
                print(f"loom run: node {self.node_rank} waiting for the other nodes at {self.master} (up to "
                      f"{self.join_timeout_s:g} s, --join-timeout)", file=sys.stderr, flush=True)  # fmt: skip

    def _name(self, node: int) -> str:
        addr = self._peers.get(node, "?")
        return f"node 0 (the master at {self.master})" if node == 0 else f"node {node} ({addr})"

    def silent_peers(self, min_s: float = 3 * BEAT_S) -> str | None:
        """Which peers this node has not heard from for ``min_s`` seconds, in words, or None."""
        if self._lost:
            return self._lost
        now = time.monotonic()
        silent = [(n, now - t) for n, t in self._heard.items() if n != self.node_rank and now - t >= min_s]
        if not silent:
            return None
        return "; ".join(f"no contact with {self._name(n)} for {s:.0f} s" for n, s in silent)

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S):
            now = time.monotonic()
            if self.server is not None:
                self._watch_nodes(now)
            else:
                self._beat(now)

    def _watch_nodes(self, now: float) -> None:
        """Node 0: note every node whose heartbeat moved; a silent one is lost after ``lost_after_s``."""
        table = self.server.table.data if self.server else {}  # one dict read at a time: no lock needed
        prefix = f"loom/{self.run_id}/alive/".encode()
        for node in range(1, self.nnodes):
            if table.get(prefix + f"left{node}".encode()) is not None:
                self._heard[node] = now
                continue
            beat = table.get(prefix + f"node{node}".encode())
            if beat is not None and beat != self._beats.get(node):
                self._beats[node] = beat
                self._heard[node] = now
            elif now - self._heard[node] > self.lost_after_s and not self._lost:
                self._lost = (
                    f"lost {self._name(node)}: no heartbeat for {now - self._heard[node]:.0f} s{_SETTING}"
                )
        joined = table.get(f"loom/{self.run_id}/round{self._round}/joined".encode())
        self._waiting = int(joined) if joined else 0

    def _beat(self, now: float) -> None:
        """Another node: bump this node's heartbeat and read how many nodes wait in the next round."""
        try:
            self._beat_store.add(f"alive/node{self.node_rank}", 1)
            self._waiting = self._beat_store.add(f"round{self._round}/joined", 0)
            self._heard[0] = now
        except StoreUnreachable as error:
            silent = now - self._heard[0]
            if "connection refused" in str(error) and not self._lost:
                self._lost = f"lost {self._name(0)}: its launcher has ended (connection refused)"
            elif silent > self.lost_after_s and not self._lost:
                self._lost = f"lost {self._name(0)}: no answer for {silent:.0f} s{_SETTING}"
