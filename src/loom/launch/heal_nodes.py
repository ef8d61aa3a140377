"""``--on-worker-failure heal`` across hosts (``--nnodes``/``--node-rank``/``--master`` or ``--cluster``); one host
runs the same code as node 0 alone. Behaviour, limits and the tests that check them: docs/fault-tolerance.md
("Across hosts").

Node 0 hosts the job's store (`loom.net.store`; the agents' keys under ``loom/RUN/nodes/``) and the `Authority`, a
`HealQuorum` over every rank with one ``--max-heals`` budget. The authority never touches a process: it writes
*orders* (``start|kill|dump RANK GEN``) to the node holding the rank and reads its *events* (``RANK GEN STATUS
WHAT``: a process ended), so local and remote ranks take one code path. Each node's `NodeAgent` supervises its own
children (`loom.launch.supervise`), carries out their orders and beats to ``nodes/K/hb``; a node silent for
``LOOM_HEAL_HEARTBEAT_TIMEOUT_S`` is lost and its ranks dropped for good (no heal spent), and a node that loses the
store as long stops its workers (they must not train alone). Every store call is bounded (`_Link`); a failed one
is retried at the next tick. Node 0's loss stops the job: the store and the authority are not replicated.

Ranks are numbered in node order (each node registers its ``-n``). Exit status: node 0's is 0 when the job trained
to the end (lost nodes and replaced workers are named, not failures), 1 when it stopped; another node's is 0 when
node 0 ended the job, 1 when it stopped it or the node lost the store.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path
from typing import Any

from loom.launch.heal import HealPolicy, HealQuorum, JobStops, exit_kind, stuck_place
from loom.launch.spec import LaunchSpec
from loom.launch.supervise import (
    LauncherStopped,
    Placement,
    Worker,
    describe_exit,
    end_workers,
    start_worker,
    stopped_by_signals,
    worker_env,
)
from loom.launch.zygote import Zygote
from loom.settings import setting

__all__ = ["Authority", "NodeAgent", "heal_across_nodes"]

TICK_S = 0.01
"""Seconds between the ticks of a node's agent and of the authority (one host's included)."""
AGENT_BEAT_S = 0.25
BYE_WAIT_S = 10.0
DUMP_WAIT_S = 5.0
"""How long node 0 waits for another node to say where its worker is stuck (`loom.launch.heal.stuck_place`)."""


class _Link:
    """An agent's bounded calls to the store: a failed call returns None (and is retried by the next tick), and
    `lost` says when the store has not answered for ``lost_after_s``."""

    def __init__(self, store: Any, lost_after_s: float) -> None:
        self.store, self.lost_after_s = store, lost_after_s
        self.failing_since: float | None = None

    def __call__(self, method: str, *args: Any) -> Any:
        try:
            result = getattr(self.store, method)(*args)
        except LauncherStopped:
            raise  # SIGTERM/SIGINT arrived during the call: the launcher stops, it is no store failure
        except Exception:  # StoreUnreachable, StoreTimeout, a reset connection: a store not answering
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            return None
        self.failing_since = None
        return result if result is not None else True

    @property
    def lost(self) -> bool:
        return self.failing_since is not None and time.monotonic() - self.failing_since > self.lost_after_s


class NodeAgent:
    """One node's workers: started, reported when they end, started again or killed on the authority's orders."""

    def __init__(self, node: int, first_rank: int, nproc: int, link: _Link, start: Any) -> None:
        self.node, self.link, self._start = node, link, start
        self.generation = {r: 0 for r in range(first_rank, first_rank + nproc)}
        self.current: dict[int, Worker] = {}
        self.all: list[Worker] = []
        self.events = self.orders_done = 0
        self._unsent: list[str] = []
        self._beat_at = 0.0
        for rank in self.generation:
            self._launch(rank, 0)

    def _launch(self, rank: int, generation: int) -> None:
        self.generation[rank] = generation
        self.current[rank] = self._start(rank, generation)
        self.all.append(self.current[rank])

    def running(self) -> list[Worker]:
        return [w for w in self.current.values() if w.proc.poll() is None]

    def dismiss(self) -> None:
        """The job has finished: its workers still running are replacements outside the epoch, not needed (one
        that exits 0 as it is stopped had finished: nothing is said of it)."""
        for w in self.running():
            w.reported = True
            w.proc.kill()
            if w.proc.wait():
                print(f"loom run: worker rank {w.rank}'s replacement (generation {self.generation[w.rank]}) was still "
                      "running, outside the job's epoch, when the others finished: stopped (the job is over)",
                      file=sys.stderr, flush=True)  # fmt: skip

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._beat_at and self.link("add", f"{self.node}/hb", 1) is not None:
            self._beat_at = now + AGENT_BEAT_S
        for w in self.current.values():
            if w.proc.poll() is not None and not w.reported:
                w.reported = True
                what = describe_exit(w) if w.proc.returncode else f"worker rank {w.rank} finished"
                self._unsent.append(f"{w.rank} {self.generation[w.rank]} {w.proc.returncode} {what}")
                if self.node and w.proc.returncode:
                    print(f"loom run: node {self.node}: {what} (reported to node 0)", file=sys.stderr,
                          flush=True)  # fmt: skip
        while self._unsent:  # in order; what could not be sent now goes at the next tick
            if self.link("set", f"{self.node}/event/{self.events + 1}", self._unsent[0]) is None:
                break
            if self.link("set", f"{self.node}/events", str(self.events + 1)) is None:
                break
            self.events += 1
            self._unsent.pop(0)
        orders = f"{self.node}/orders"
        count = self.link("get", orders) if self.link("check", [orders]) else None
        for i in range(self.orders_done + 1, int(count or 0) + 1):
            order = self.link("get", f"{self.node}/order/{i}")
            if order is None:
                break
            self._obey(order.decode())
            self.orders_done = i

    def place_of(self, rank: int, generation: int) -> str | None:
        """Where rank ``rank``'s process of ``generation`` is stuck: its stacks printed in this node's output, and
        its main thread's innermost frame returned (`stuck_place`); None if it is gone or printed nothing."""
        worker = self.current.get(rank)
        if worker is None or self.generation[rank] != generation or worker.proc.poll() is not None:
            return None
        return stuck_place(worker.proc.pid, worker.tail)

    def _obey(self, order: str) -> None:
        verb, rank_text, gen_text = order.split()
        rank, generation = int(rank_text), int(gen_text)
        if verb == "dump":  # before a kill for not checking in: the stacks here, the place to node 0
            self.link("set", f"{self.node}/place/{rank}/{generation}", self.place_of(rank, generation) or "")
        elif verb == "start":
            if self.node:
                print(f"loom run: node {self.node}: starting rank {rank}'s replacement (generation {generation}), "
                      "as node 0's quorum granted", file=sys.stderr, flush=True)  # fmt: skip
            self._launch(rank, generation)
        elif self.generation[rank] == generation:
            self.current[rank].proc.kill()  # "kill": a frozen or silent worker (SIGKILL: a stopped one too)


class Authority:
    """Node 0's quorum over every rank of the job, acting through orders and events (module docstring)."""

    def __init__(self, sizes: list[int], policy: HealPolicy, link: _Link, job_store: Any,
                 local: NodeAgent | None = None) -> None:  # fmt: skip
        """``local``: node 0's own agent, which the authority asks directly (its orders wait for its next tick)."""
        self.link, self.sizes, self.local = link, sizes, local
        self.node_of = [k for k, n in enumerate(sizes) for _ in range(n)]
        self.running: dict[int, int | None] = dict.fromkeys(range(len(self.node_of)), 0)
        self.lost_nodes: set[int] = set()
        self.events_done = [0] * len(sizes)
        self.orders = [0] * len(sizes)
        self.beats: dict[int, tuple[int, float]] = {}
        self.quorum = HealQuorum(
            len(self.node_of), policy, job_store, self._restart, self._alive, self._kill, self._dump
        )
        self.grace_s = setting("LOOM_HEAL_GROUP_TIMEOUT_S")

    def _alive(self, rank: int) -> bool:
        return rank not in self.quorum.gone and self.running[rank] == self.quorum.generation[rank]

    def _order(self, node: int, order: str) -> None:
        self.orders[node] += 1
        self.link("set", f"{node}/order/{self.orders[node]}", order)
        self.link("set", f"{node}/orders", str(self.orders[node]))

    def _restart(self, rank: int, generation: int) -> None:
        self.running[rank] = generation
        self._order(self.node_of[rank], f"start {rank} {generation}")

    def _kill(self, rank: int) -> None:
        self._order(self.node_of[rank], f"kill {rank} {self.quorum.generation[rank]}")

    def _dump(self, rank: int) -> str | None:
        """Where rank ``rank`` is stuck, asked of the node that holds it (a ``dump`` order, its answer in
        ``K/place/RANK/GEN``, read bounded) within `DUMP_WAIT_S`; None when that node says nothing in time."""
        node, generation = self.node_of[rank], self.quorum.generation[rank]
        if node == 0:
            return self.local.place_of(rank, generation) if self.local is not None else None
        self._order(node, f"dump {rank} {generation}")
        key, deadline = f"{node}/place/{rank}/{generation}", time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline:
            place = self.link("get", key) if self.link("check", [key]) else None
            if isinstance(place, bytes):
                return place[:500].decode(errors="replace") or None
            time.sleep(TICK_S)
        return None

    def done(self) -> bool:
        return not any(self._alive(r) for r in self.running)

    def waiting_only(self) -> bool:
        """The job is ending and every rank still running is a replacement (generation > 0) outside the epoch: only
        replacements wait (not needed). A first-generation worker is awaited: its own error fails the job."""
        q = self.quorum
        return q.ending and not any(
            self._alive(r) and (q.is_member(r) or not q.generation[r]) for r in self.running
        )

    def tick(self) -> None:
        for node in range(len(self.sizes)):
            if node not in self.lost_nodes:
                self._read_events(node)
                if node:
                    self._check_node(node)
        self.quorum.tick()

    def _read_events(self, node: int) -> None:
        count = self.link("get", f"{node}/events") if self.link("check", [f"{node}/events"]) else None
        for i in range(self.events_done[node] + 1, int(count or 0) + 1):
            event = self.link("get", f"{node}/event/{i}")
            if event is None:
                return
            self.events_done[node] = i
            rank_text, gen_text, status_text, what = event.decode().split(" ", 3)
            rank, generation, status = int(rank_text), int(gen_text), int(status_text)
            if self.running[rank] == generation == self.quorum.generation[rank]:
                self.running[rank] = None
                self.quorum.ended(rank, status, what)

    def _check_node(self, node: int) -> None:
        count = self.link("get", f"{node}/hb") if self.link("check", [f"{node}/hb"]) else b"0"
        now, seen = time.monotonic(), self.beats.get(node)
        if seen is None or seen[0] != int(count or 0):
            self.beats[node] = (int(count or 0), now)
        elif now - seen[1] > self.quorum.heartbeat_timeout_s:
            self.lost_nodes.add(node)
            ranks = [r for r, k in enumerate(self.node_of) if k == node and self._alive(r)]
            what = f"node {node} lost: its agent sent no heartbeat for {self.quorum.heartbeat_timeout_s:g} s"
            print(f"loom run: {what} (LOOM_HEAL_HEARTBEAT_TIMEOUT_S); its ranks {ranks} are dropped, not "
                  "replaced; the others go on", file=sys.stderr, flush=True)  # fmt: skip
            for r in ranks:  # the next epoch is formed without them (below --min-workers: the job stops)
                self.quorum.drop(r, f"{what} (rank {r})", self.grace_s)


def _register(spec: LaunchSpec, client: Any) -> list[int]:
    """Every node's ``-n``, in node order, once all have registered (within ``--join-timeout``)."""
    if client.add(f"{spec.node_rank}/claim", 1) > 1:
        raise ValueError(f"two nodes run with --node-rank {spec.node_rank}. HINT: give each its own rank")
    client.set(f"{spec.node_rank}/nproc", str(spec.nproc))
    keys = [f"{k}/nproc" for k in range(spec.nnodes)]
    try:
        client.wait(keys, datetime.timedelta(seconds=spec.join_timeout_s))
    except Exception:
        missing = [k for k in range(spec.nnodes) if not client.check([f"{k}/nproc"])]
        raise ValueError(f"node(s) {missing} did not join within --join-timeout {spec.join_timeout_s:g} s. "
                         "HINT: run the same loom run command on every node") from None  # fmt: skip
    return [int(client.get(key)) for key in keys]


def heal_across_nodes(spec: LaunchSpec, run_id: str, host: str, port: int,
                      worker_args: list[str]) -> tuple[int, int | None]:  # fmt: skip
    """Run this node's share of a healing job of ``spec.nnodes`` nodes (module docstring); returns the status and
    the replacements started (None: unknown, node 0 lost).
    Node 0 hosts the store at ``host:port`` (port 0: one host's, on a port the OS picks)."""
    from loom.net.store import LoomStore, StoreServer, job_secret

    secret, node, logs = job_secret(), spec.node_rank, Path(spec.run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    server = StoreServer(host, port, secret) if node == 0 else None
    port = server.port if server is not None else port
    prefix = f"loom/{run_id}/nodes/"
    lost_after_s = setting("LOOM_HEAL_HEARTBEAT_TIMEOUT_S")
    joining = LoomStore(
        host, port, secret, prefix=prefix, server=server, connect_timeout_s=spec.join_timeout_s
    )
    try:
        sizes = _register(spec, joining)
        world = sum(sizes)
        if node == 0 and not 1 <= spec.min_workers <= world:
            raise ValueError(f"--min-workers {spec.min_workers} must be in 1..{world} (the job's workers)")
    except Exception as error:
        print(f"loom run: node {node}: {error}", file=sys.stderr, flush=True)
        if server is not None:
            server.close()
        return 2, 0
    bound_s = min(2.0, lost_after_s)
    bounded = LoomStore(host, port, secret, prefix=prefix, server=server, connect_timeout_s=bound_s,
                        io_timeout_s=bound_s)  # fmt: skip
    link = _Link(bounded, lost_after_s)
    first = sum(sizes[:node])
    placement = Placement(first, world, node, spec.nnodes, host)

    zygote = Zygote(worker_args, worker_env(first, spec.nproc, port, run_id, logs / "zygote.error.json", "heal",
                                            0, placement))  # fmt: skip

    def start(rank: int, generation: int) -> Worker:
        return start_worker(rank, spec.nproc, worker_args, port, run_id, logs, "heal", generation, placement,
                            zygote)  # fmt: skip

    agent: NodeAgent | None = None
    try:
        with stopped_by_signals():
            zygote.start()
            # beat while the zygote imports torch (10 s and more on a loaded host), or node 0 drops this node
            ready_by = time.monotonic() + setting("LOOM_ZYGOTE_READY_S")
            while not zygote.settled and time.monotonic() < ready_by:
                link("add", f"{node}/hb", 1)
                time.sleep(AGENT_BEAT_S)
            agent = NodeAgent(node, first, spec.nproc, link, start)
            if server is None:
                return _follow(agent, link, host, port, spec.max_heals)
            job = LoomStore(prefix=f"loom/{run_id}/job/", server=server)
            authority = Authority(sizes, HealPolicy(spec.max_heals, spec.min_workers), link, job, local=agent)
            return _lead(agent, authority, link)
    except LauncherStopped as stop:
        where = f"node {node} " if spec.nnodes > 1 else ""
        print(f"loom run: {where}stopped by signal {stop}; its workers were terminated", file=sys.stderr)
        return 128 + stop.signum, 0
    finally:
        end_workers(agent.all if agent is not None else [], spec.shutdown_timeout_s, zygote)
        if server is not None:
            server.close()


def _lead(agent: NodeAgent, authority: Authority, link: _Link) -> tuple[int, int]:
    """Node 0 (or the one host): its agent's ticks and the authority's, until every worker has ended or only
    replacements wait (they are stopped); then every other node is told and awaited."""
    status, quorum = 0, authority.quorum
    try:
        while not authority.done() and not authority.waiting_only():
            agent.tick()
            authority.tick()
            time.sleep(TICK_S)
        agent.dismiss()
        link("set", "end", str(quorum.heals))  # the followers' summary names them
        # across hosts the losses are summed up here (one host names each as it goes)
        if quorum.lost and len(authority.sizes) > 1:
            print(f"loom run: the job finished after {len(quorum.lost)} loss(es), {quorum.heals} replacement(s) "
                  f"started: {'; '.join(quorum.lost)}", file=sys.stderr)  # fmt: skip
    except JobStops as stop:
        print(f"loom run: {stop}", file=sys.stderr, flush=True)
        link("set", "heals", str(quorum.heals))  # before "stop": the followers' summary names them
        link("set", "stop", str(stop))
        status = 1
    deadline = time.monotonic() + BYE_WAIT_S
    others = [k for k in range(1, len(authority.sizes)) if k not in authority.lost_nodes]
    while others and time.monotonic() < deadline:
        others = [k for k in others if not link("check", [f"{k}/bye"])]
        time.sleep(TICK_S)
    if status or quorum.ending:
        return status, quorum.heals
    print("loom run: the job failed: no worker finished", file=sys.stderr)
    return 1, quorum.heals


def _told_heals(link: _Link, key: str, most: int) -> int | None:
    """The heals node 0 told under ``key``, read from the store: only an int in 0..``most`` (--max-heals) is
    believed; anything else (or no answer) is None, unknown."""
    told = link("get", key)
    try:
        heals = int(told) if isinstance(told, bytes) else -1
    except ValueError:
        return None
    return heals if 0 <= heals <= most else None


def _follow(agent: NodeAgent, link: _Link, host: str, port: int, most: int) -> tuple[int, int | None]:
    """Node K > 0: its agent's ticks until node 0 ends or stops the job, or the store is lost (the heals unknown);
    ``most``: --max-heals, the bound of the heals node 0 tells."""
    while True:
        agent.tick()
        if link.lost:
            ranks = [w.rank for w in agent.running()]
            print(f"loom run: node {agent.node} lost node 0 (the job's store and quorum at {host}:{port}): no "
                  f"answer for {link.lost_after_s:g} s (LOOM_HEAL_HEARTBEAT_TIMEOUT_S); stopping its workers "
                  f"(ranks {ranks})", file=sys.stderr, flush=True)  # fmt: skip
            return 1, None
        if link("check", ["stop"]):
            reason = link("get", "stop")
            print(f"loom run: node {agent.node}: node 0 stopped the job: {reason.decode() if reason else '?'}",
                  file=sys.stderr, flush=True)  # fmt: skip
            link("set", f"{agent.node}/bye", "1")
            return 1, _told_heals(link, "heals", most)
        if link("check", ["end"]):
            agent.dismiss()
            link("set", f"{agent.node}/bye", "1")
            failed = [w for w in agent.all if exit_kind(w.proc.poll() or 0) == "error"]
            return (1 if failed else 0), _told_heals(link, "end", most)
        time.sleep(TICK_S)
