"""A parameter-server process: ``python -m loom.ps.server --index i --num-servers K --bind ADDR:PORT``.

One ZeroMQ ROUTER socket, one thread, one event loop. Every incoming message is checked by `loom.ps.wire` (size,
header, MAC with the job secret from ``LOOM_JOB_SECRET``, epoch, sequence number) before anything in it is
decoded; what fails is dropped, counted by reason, and never answered. Requests that must wait (a ``sync`` push
until every worker has pushed that step, an ``ssp`` pull until the slowest worker is close enough) are parked with
the address to answer and answered later, so one slow worker never blocks the loop.

The server holds any number of models ("namespaces"), each a `ModelShard` with its own plan, optimizer, clocks and
checkpoint. It listens on loopback unless ``--bind`` names another interface.

Checkpoints, so that a server can die: with a checkpoint directory (``--checkpoint-dir``, else
``$LOOM_PS_CHECKPOINT_DIR``, else ``$LOOM_RUN_DIR/ps``, which ``loom run`` sets) a model is saved when it is created
(INIT) or restored (RESTORE), on request (SAVE), on SIGTERM, and on the schedule its workers chose
(`loom.parallel.ps.parameter_server.ParameterServerConfig`): after ``checkpoint_every`` updates, or once the oldest
unsaved update is ``checkpoint_interval_s`` old (and at least 20 times as long as the last save took, so that saving
by time never takes more than about 5% of the server's time, however large the model). A sync step is saved
*before* its replies go out (write-ahead): a restarted server is never behind what a worker has seen, so only
the step in flight is repeated (its workers resend their pushes). A server restarted by the launcher (`loom.launch.servers`) resumes from the last
save; in async/ssp the updates since then are lost, and the workers see its version go back (HELLO answers with
the version each model was resumed at). Li et al. 2014 replicate shards on neighbouring servers to lose nothing;
loom does not.

`loom.fit`'s checkpoints do not use those files: a worker reads a model's whole state with STATE (tensors and
JSON, as in the files) and puts it back with RESTORE, which replaces the model outright, answers the requests it
leaves waiting with an error, and is applied once per request token.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq
from safetensors import SafetensorError
from zmq.utils.monitor import recv_monitor_message

from loom.ps.gate import HELLO_BYTES, Inbox, InboxLimits, chunk_key, secure_server, send_frame
from loom.ps.plan import Piece
from loom.ps.shard import ModelShard, ShardSettings
from loom.ps.wire import (
    DropCounters,
    Frame,
    FrameDropped,
    MessageType,
    SessionTable,
    WireLimits,
    decode,
    encode,
)
from loom.ps.wire import secret_from_hex as _secret_from_hex

__all__ = ["ServerConfig", "ParameterServerProcess", "main"]

_NAMESPACE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


@dataclass(frozen=True)
class ServerConfig:
    """How one server process runs."""

    index: int = 0
    """This server's index among ``num_servers``."""
    num_servers: int = 1
    bind: str = "127.0.0.1:0"
    """``HOST:PORT`` to listen on; loopback unless an interface is named explicitly."""
    checkpoint_dir: Path | None = None
    """Where this server's shards are saved (a ``server<index>`` folder inside it); None: no checkpoints."""
    limits: WireLimits = field(default_factory=WireLimits)
    listen_fd: int | None = None
    """A listening TCP socket's file descriptor, already bound to ``bind``, to accept on instead of binding: the
    launcher keeps the port across a restart of this server, so no other process can take it meanwhile."""
    poll_ms: int = 50
    """How often parked requests and worker timeouts are re-examined when no message arrives."""

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_servers:
            raise ValueError(f"--index {self.index} is outside 0..{self.num_servers - 1}")
        host, _, port = self.bind.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--bind must be HOST:PORT, got {self.bind!r}")


def _plan_key(pieces) -> list[tuple[int, str, int, int]]:
    """What two plans must share for one model's pieces to be interchangeable."""
    return sorted((p.id, p.name, p.start, p.stop) for p in pieces)


@dataclass
class _Parked:
    identity: bytes
    frame: Frame
    worker: int
    clock: int


class ParameterServerProcess:
    """The event loop of one server; `serve()` runs until `stop()` (or SIGTERM in `main`)."""

    def __init__(self, config: ServerConfig, secret: bytes) -> None:
        self.config = config
        self.secret = secret
        self.epoch = int.from_bytes(os.urandom(8), "little") | 1
        self.sessions = SessionTable(self.epoch)
        self.counters = DropCounters()
        self.models: dict[str, ModelShard] = {}
        self.failed: dict[str, str] = {}
        self.parked_pulls: dict[str, dict[int, _Parked]] = {}
        self.parked_pushes: dict[str, dict[int, dict[int, _Parked]]] = {}
        self.restore_tokens: dict[str, list[str]] = {}
        """Per model, the tokens of the last RESTOREs applied (a repeat is answered, not applied again)."""
        self._stopping = False
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.gate = secure_server(self.context, self.socket, secret)
        self.chunk_key = chunk_key(secret)
        budget = InboxLimits(total_bytes=max(InboxLimits.total_bytes, 2 * config.limits.max_frame))
        self.inbox = Inbox(self.chunk_key, config.limits, budget, self.counters.drop, self._fresh)
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        if config.listen_fd is not None:
            self.socket.setsockopt(zmq.USE_FD, config.listen_fd)
        self.socket.bind(f"tcp://{config.bind}")
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")
        self._restore()

    # -- lifecycle --------------------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        print(f"loom.ps.server[{self.config.index}]: {text}", flush=True)

    @property
    def shard_dir(self) -> Path | None:
        base = self.config.checkpoint_dir
        return None if base is None else base / f"server{self.config.index}"

    def _restore(self) -> None:
        """Load every model saved in `shard_dir` (a restarted server). A file that does not load raises
        `ValueError` naming it: starting empty would silently throw the model away."""
        if self.shard_dir is None or not self.shard_dir.is_dir():
            return
        for path in sorted(self.shard_dir.glob("*.json")):
            shard = ModelShard.load(path)
            self.models[shard.name] = shard
            self.log(f"resumed model {shard.name!r} at version {shard.version} from {path}")

    def checkpoint(self) -> list[str]:
        """Save every model now; returns the files written."""
        saved = (self._save_shard(shard) for shard in self.models.values())
        return [str(path) for path in saved if path is not None]

    def _save_shard(self, shard: ModelShard) -> Path | None:
        """Save one model; a failure (disk full, permissions) is logged, not raised: training goes on without
        the protection, and the log says so once (and again when saving works again)."""
        if self.shard_dir is None:
            return None
        started = time.monotonic()
        try:
            path = shard.save(self.shard_dir)
        except (OSError, SafetensorError) as error:  # safetensors reports a full disk as its own error
            if shard.save_error is None:
                self.log(f"model {shard.name!r}: could not save its checkpoint into {self.shard_dir}: {error}; "
                         "training goes on, but a restart of this server would lose the updates since the "
                         "last save")  # fmt: skip
            shard.save_error = str(error)
            return None
        if shard.save_error is not None:
            self.log(f"model {shard.name!r}: saving works again")
            shard.save_error = None
        shard.save_seconds = time.monotonic() - started
        shard.saved_at = time.monotonic()
        shard.unsaved = 0
        return path

    def _save_if_due(self, shard: ModelShard, now: float) -> None:
        """Save ``shard`` if its schedule says so (see the module docstring)."""
        settings = shard.settings
        if not shard.unsaved or self.shard_dir is None:
            return
        by_count = 0 < settings.checkpoint_every <= shard.unsaved
        interval = max(settings.checkpoint_interval_s, 20.0 * shard.save_seconds)
        by_time = settings.checkpoint_interval_s > 0 and now - shard.saved_at >= interval
        if by_count or by_time:
            self._save_shard(shard)

    def stop(self) -> None:
        self._stopping = True

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        self.log(f"listening on {self.address}")
        try:
            while not self._stopping:
                events = dict(poller.poll(self.config.poll_ms))
                if self.monitor in events:
                    recv_monitor_message(self.monitor)
                    self.counters.drop("bad_handshake")
                drained = True
                if self.socket in events:
                    for _ in range(256):  # drain a burst of chunks before looking at the clocks again
                        try:
                            parts = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if len(parts) != 2:  # a chunk is one message; ROUTER adds the peer's identity
                            self.counters.drop("malformed")
                            continue
                        data = self.inbox.receive(parts[0].bytes, parts[1].buffer, time.monotonic())
                        if data is not None:
                            self.handle([parts[0], data])
                    else:
                        drained = False
                now = time.monotonic()
                if drained:  # only when nothing waits in ZeroMQ's queues is a peer's silence real
                    self.inbox.expire(now)
                self._tick(now)
        finally:
            if self.models:
                self.checkpoint()
            self.close()

    def close(self) -> None:
        """Close the sockets, stop the connection gate's thread and end the ZeroMQ context."""
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)
        self.gate.stop()
        self.context.term()

    # -- one message ------------------------------------------------------------------------------------------
    def handle(self, parts: list) -> None:
        """Decode, admit and answer one whole frame: ``parts`` is [identity, frame] (``zmq.Frame``s or the frame's
        bytes, as `Inbox` reassembles it)."""
        if len(parts) != 2:
            self.counters.drop("malformed")
            return
        identity = parts[0].bytes
        data = parts[1].buffer if hasattr(parts[1], "buffer") else parts[1]
        try:
            frame = decode(self.secret, data, self.config.limits)
            self.sessions.admit(frame)
        except FrameDropped as dropped:
            self.counters.drop(dropped.reason)
            return
        self.counters.accepted += 1
        self.counters.bytes_in += frame.nbytes
        handler = self._handlers().get(frame.type)
        if handler is None:
            self._error(identity, frame, f"message type {frame.type.name} is not a request")
            return
        try:
            handler(identity, frame)
        except (ValueError, KeyError, TypeError, RuntimeError) as error:
            self.counters.drop("rejected")
            self._error(identity, frame, f"{type(error).__name__}: {error}")

    def _fresh(self, kind: int, epoch: int, session: int, seq: int, size: int) -> None:
        """Vet an open chunk's header before its frame's bytes are kept (see `loom.ps.gate.Inbox`)."""
        if not MessageType.HELLO <= kind < MessageType.REPLY:
            raise FrameDropped("malformed", f"message type {kind} is not a request")
        if kind == MessageType.HELLO and size > HELLO_BYTES:
            raise FrameDropped("oversized", f"a HELLO of {size} bytes")
        self.sessions.check(kind, epoch, session, seq)

    def _handlers(self):
        return {
            MessageType.HELLO: self._hello,
            MessageType.INIT: self._init,
            MessageType.PULL: self._pull,
            MessageType.PULL_ROWS: self._pull_rows,
            MessageType.PUSH: self._push,
            MessageType.BYE: self._bye,
            MessageType.STATS: self._stats,
            MessageType.SAVE: self._save,
            MessageType.STATE: self._state,
            MessageType.RESTORE: self._restore_model,
        }

    def _reply(self, identity: bytes, frame: Frame, meta: dict[str, Any], tensors=None) -> None:
        data = encode(self.secret, MessageType.REPLY, epoch=self.epoch, session=frame.session, seq=frame.seq,
                      meta=meta, tensors=tensors)  # fmt: skip
        self.counters.bytes_out += len(data)
        send_frame(self.socket, self.chunk_key, data, identity)

    def _error(self, identity: bytes, frame: Frame, message: str) -> None:
        data = encode(self.secret, MessageType.ERROR, epoch=self.epoch, session=frame.session, seq=frame.seq,
                      meta={"error": f"parameter server {self.config.index}: {message}"})  # fmt: skip
        send_frame(self.socket, self.chunk_key, data, identity)

    def _model(self, frame: Frame) -> tuple[str, ModelShard, int]:
        name = frame.meta.get("ns")
        if not isinstance(name, str) or name not in self.models:
            raise ValueError(f"model {name!r} was not initialized on this server. HINT: call setup() first")
        if name in self.failed:
            raise RuntimeError(self.failed[name])
        shard = self.models[name]
        worker = frame.meta.get("worker")
        if not isinstance(worker, int):
            raise ValueError(f"worker {worker!r} is outside 0..{shard.clocks.num_workers - 1}")
        shard.clocks.check_worker(worker)
        if shard.clocks.seen(worker, time.monotonic()):
            self.log(f"model {name!r}: worker {worker} is back")
        return name, shard, worker

    # -- handlers ---------------------------------------------------------------------------------------------
    def _hello(self, identity: bytes, frame: Frame) -> None:
        """The server's index, each model's version and, for models this process loaded from its checkpoint,
        the version it resumed at (a client greeting a restarted server learns what was lost)."""
        versions = {name: shard.version for name, shard in self.models.items()}
        resumed = {n: s.resumed_version for n, s in self.models.items() if s.resumed_version is not None}
        self._reply(identity, frame, {"index": self.config.index, "models": versions, "resumed": resumed})

    def _init(self, identity: bytes, frame: Frame) -> None:
        name = frame.meta.get("ns")
        if not isinstance(name, str) or not _NAMESPACE.match(name):
            raise ValueError(f"model name {name!r} must be 1-64 letters, digits, '_' or '-'")
        worker = frame.meta.get("worker")
        if isinstance(worker, bool) or not isinstance(worker, int):
            raise ValueError(f"INIT names worker {worker!r}; expected the worker's rank")
        mine = [Piece.from_json(p) for p in frame.meta["pieces"]]
        settings = ShardSettings(**frame.meta["settings"])
        if name in self.models:
            if _plan_key(self.models[name].pieces.values()) != _plan_key(mine):
                raise ValueError(
                    f"model {name!r} exists here with a different plan. HINT: use another namespace"
                )
            self.models[name].clocks.check_worker(worker)
            # A worker (re)joining: a restarted job starts over from here, so a failed sync step is forgotten.
            if self.failed.pop(name, None) is not None:
                self.log(f"model {name!r}: worker {worker} rejoined; the failed step is cleared")
        else:
            values = {p.id: frame.tensors[f"p{p.id}"] for p in mine}
            self.models[name] = ModelShard(name, settings, mine, values)
            self.log(f"model {name!r}: {len(mine)} pieces, {sum(p.numel for p in mine)} values, "
                     f"{settings.optimizer}, mode {settings.mode}")  # fmt: skip
            self._save_shard(self.models[name])  # a server restarted before its first update still has it
        shard = self.models[name]
        shard.clocks.check_worker(worker)
        self._forget_parked(name, worker)
        clock = shard.clocks.rejoin(worker, time.monotonic())
        self._reply(identity, frame, {"version": shard.version, "clock": clock})

    def _forget_parked(self, name: str, worker: int) -> None:
        """Drop requests parked by an earlier incarnation of ``worker``: a restarted worker resends them, and a
        stale sync push left behind would otherwise complete its step with the old attempt's gradient."""
        self.parked_pulls.get(name, {}).pop(worker, None)
        for waiting in self.parked_pushes.get(name, {}).values():
            waiting.pop(worker, None)

    def _pull(self, identity: bytes, frame: Frame) -> None:
        name, shard, worker = self._model(frame)
        parked = _Parked(identity, frame, worker, int(frame.meta["clock"]))
        if frame.meta.get("peek"):  # a read of the current values, outside the consistency model
            self._reply(identity, frame, {"version": shard.version, "slowest": -1}, shard.dense_values())
            return
        # The worker's clock moves here only when this server restarted from a checkpoint behind the worker.
        moved = shard.clocks.catch_up(worker, parked.clock)
        if shard.clocks.may_pull(worker, parked.clock):
            self._grant_pull(shard, parked)
        else:
            self.parked_pulls.setdefault(name, {})[worker] = parked
        if moved:
            self._release_pulls(name, shard)

    def _grant_pull(self, shard: ModelShard, parked: _Parked) -> None:
        slowest = shard.clocks.grant(parked.worker, parked.clock)
        meta = {"version": shard.version, "slowest": slowest}
        self._reply(parked.identity, parked.frame, meta, shard.dense_values())

    def _pull_rows(self, identity: bytes, frame: Frame) -> None:
        _, shard, _ = self._model(frame)
        self._reply(identity, frame, {"version": shard.version}, shard.rows(frame.tensors))

    def _push(self, identity: bytes, frame: Frame) -> None:
        name, shard, worker = self._model(frame)
        shard.check_gradients(frame.tensors)
        if "lrs" in frame.meta:
            shard.check_learning_rates(frame.meta["lrs"])
        clock = int(frame.meta["clock"])
        if clock < shard.clocks.clocks[worker]:  # a resent push that was applied already
            self._reply(identity, frame, {"version": shard.version, "staleness": 0, "duplicate": True})
            return
        parked = _Parked(identity, frame, worker, clock)
        if shard.settings.mode == "sync":
            self.parked_pushes.setdefault(name, {}).setdefault(clock, {})[worker] = parked
            self._complete_sync(name, shard)
            return
        if _flag(frame):  # a non-finite loss or gradient: the worker sent its flag, not its update
            shard.clocks.pushed(worker, clock)
            self._reply(
                identity, frame, {"version": shard.version, "staleness": 0, "flags": [[worker, _flag(frame)]]}
            )
            self._release_pulls(name, shard)
            return
        staleness = max(0, shard.version - int(frame.meta["version"]))  # < 0 after a restart behind it
        shard.apply([frame.tensors], frame.meta.get("lrs"))
        shard.clocks.pushed(worker, clock)
        shard.record_staleness(staleness)
        self._after_update(shard)
        self._reply(identity, frame, {"version": shard.version, "staleness": staleness})
        self._release_pulls(name, shard)

    def _complete_sync(self, name: str, shard: ModelShard) -> None:
        steps = self.parked_pushes.get(name, {})
        for clock in sorted(steps):
            waiting = steps[clock]
            if not set(shard.clocks.active()) <= set(waiting):
                return
            order = sorted(waiting)
            staleness = [max(0, shard.version - int(waiting[w].frame.meta["version"])) for w in order]
            # A step any worker flagged non-finite is applied nowhere: every worker is told whose flag it was.
            flags = [[w, _flag(waiting[w].frame)] for w in order if _flag(waiting[w].frame)]
            if not flags:
                shard.apply(
                    [waiting[w].frame.tensors for w in order], waiting[order[0]].frame.meta.get("lrs")
                )
            loss_sum = sum(float(waiting[w].frame.meta.get("loss_sum", 0.0)) for w in order)
            for w, stale in zip(order, staleness, strict=True):
                shard.clocks.pushed(w, clock)
                shard.record_staleness(stale)
            if not flags:
                self._after_update(shard)
            for w, stale in zip(order, staleness, strict=True):
                meta = {"version": shard.version, "staleness": stale, "loss_sum": loss_sum, "flags": flags}
                self._reply(waiting[w].identity, waiting[w].frame, meta)
            del steps[clock]

    def _after_update(self, shard: ModelShard) -> None:
        """Count the update and save if due: called before the update's replies go out (write-ahead)."""
        now = time.monotonic()
        if not shard.unsaved:
            shard.saved_at = now  # the time schedule runs from the first update the checkpoint lacks
        shard.unsaved += 1
        self._save_if_due(shard, now)

    def _release_pulls(self, name: str, shard: ModelShard) -> None:
        parked = self.parked_pulls.get(name, {})
        for worker in sorted(parked):
            if shard.clocks.may_pull(worker, parked[worker].clock):
                self._grant_pull(shard, parked.pop(worker))

    def _bye(self, identity: bytes, frame: Frame) -> None:
        name, shard, worker = self._model(frame)
        shard.clocks.finish(worker)
        self._reply(identity, frame, {"version": shard.version})
        self._release_pulls(name, shard)
        if shard.settings.mode == "sync":
            self._complete_sync(name, shard)

    def _stats(self, identity: bytes, frame: Frame) -> None:
        models = {name: shard.stats() for name, shard in self.models.items()}
        meta = {"index": self.config.index, "wire": self.counters.snapshot(), "models": models}
        self._reply(identity, frame, meta)

    def _save(self, identity: bytes, frame: Frame) -> None:
        self._reply(identity, frame, {"saved": self.checkpoint()})

    def _state(self, identity: bytes, frame: Frame) -> None:
        """The model's whole state (`ModelShard.state`), for a `loom.fit` checkpoint."""
        _, shard, _ = self._model(frame)
        meta, tensors = shard.state()
        self._reply(identity, frame, {"state": meta}, tensors)

    def _restore_model(self, identity: bytes, frame: Frame) -> None:
        """Replace the model by the state a STATE reply gave (values, optimizer state, version, every worker's
        clock): a `loom.fit` resume, into fresh servers or into servers that went on past the checkpoint.

        The checkpoint wins over whatever the server holds: requests parked by the model's earlier trajectory
        are answered with an error, a failed sync step is forgotten, every worker is active again. A restore is
        applied once per ``token`` (the client resends a request that seems lost, and a late copy must not undo
        the steps taken since)."""
        name, token = frame.meta.get("ns"), frame.meta.get("token")
        if not isinstance(name, str) or name not in self.models:
            raise ValueError(f"model {name!r} was not initialized on this server. HINT: call setup() first")
        if not isinstance(token, str) or not 0 < len(token) <= 64:
            raise ValueError("RESTORE needs a 'token' string of 1-64 characters")
        held = self.models[name]
        held.clocks.check_worker(frame.meta.get("worker", -1))
        applied = self.restore_tokens.setdefault(name, [])
        if token not in applied:
            state = frame.meta.get("state")
            if not isinstance(state, dict):
                raise ValueError("RESTORE carries no 'state' object")
            shard = ModelShard.from_state({**state, "name": name}, frame.tensors, held.settings)
            if _plan_key(shard.pieces.values()) != _plan_key(held.pieces.values()):
                raise ValueError(
                    f"the state to restore cuts model {name!r} differently from this server's plan"
                )
            now = time.monotonic()
            shard.clocks.status = ["active"] * shard.clocks.num_workers
            shard.clocks.last_seen = [now] * shard.clocks.num_workers
            self._answer_waiting(
                name, f"model {name!r} was restored from a checkpoint while this request waited"
            )
            self.failed.pop(name, None)
            self.models[name] = shard
            self._save_shard(shard)  # a restart must not bring back what the restore replaced
            applied[:] = [*applied[-63:], token]
            self.log(f"model {name!r}: restored at version {shard.version}, clocks {shard.clocks.clocks} "
                     f"(was version {held.version})")  # fmt: skip
        shard = self.models[name]
        self._reply(identity, frame, {"version": shard.version, "clocks": shard.clocks.clocks})

    def _answer_waiting(self, name: str, message: str) -> None:
        """Answer every request of model ``name`` still parked with an error (nobody is left waiting)."""
        for parked in self.parked_pulls.pop(name, {}).values():
            self._error(parked.identity, parked.frame, message)
        for waiting in self.parked_pushes.pop(name, {}).values():
            for parked in waiting.values():
                self._error(parked.identity, parked.frame, message)

    # -- time -------------------------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        for shard in self.models.values():
            self._save_if_due(shard, now)  # updates left unsaved when the pushes stopped
        for name, shard in self.models.items():
            if name in self.failed or shard.settings.mode == "async":
                continue
            if shard.settings.mode == "sync" and not self.parked_pushes.get(name):
                continue  # in sync a silence only matters while a step waits for it
            waiting = set(self.parked_pulls.get(name, {}))
            for step in self.parked_pushes.get(name, {}).values():
                waiting.update(step)
            for worker in shard.clocks.expire(now, frozenset(waiting)):
                silent = now - shard.clocks.last_seen[worker]
                if shard.settings.mode == "ssp":
                    self.log(f"model {name!r}: worker {worker} silent for {silent:.1f} s "
                             f"(timeout {shard.settings.timeout_s} s); ssp no longer waits for it")  # fmt: skip
                    self._release_pulls(name, shard)
                else:
                    self._fail_sync(name, worker, silent)
                    break

    def _fail_sync(self, name: str, worker: int, silent: float) -> None:
        message = (f"sync step failed: worker {worker} did not push within {silent:.1f} s "
                   "(killed or hung?). HINT: use mode='async' or 'ssp' to tolerate lost workers")  # fmt: skip
        self.log(f"model {name!r}: {message}")
        self.failed[name] = message
        for waiting in self.parked_pushes.pop(name, {}).values():
            for parked in waiting.values():
                self._error(parked.identity, parked.frame, message)


def _flag(frame: Frame) -> float:
    """The non-finite flag a worker's push carries instead of its gradient (0: none, the push is an update)."""
    value = frame.meta.get("nonfinite", 0)
    return float(value) if isinstance(value, (int, float)) and value == value and value > 0 else 0.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loom.ps.server", description=__doc__.splitlines()[0])
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--num-servers", type=int, default=1)
    p.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT (default: loopback, a free port)")
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument(
        "--listen-fd", type=int, default=None, help="a listening socket bound to --bind (loom run's)"
    )
    p.add_argument("--max-payload-mb", type=float, default=256.0, help="largest tensor payload accepted")
    return p.parse_args(argv)


def _default_checkpoint_dir() -> Path | None:
    if os.environ.get("LOOM_PS_CHECKPOINT_DIR"):
        return Path(os.environ["LOOM_PS_CHECKPOINT_DIR"])
    if os.environ.get("LOOM_RUN_DIR"):
        return Path(os.environ["LOOM_RUN_DIR"]) / "ps"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    secret_hex = os.environ.get("LOOM_JOB_SECRET")
    if not secret_hex:
        print("loom.ps.server: LOOM_JOB_SECRET is not set. HINT: start servers with `loom run --servers K`",
              file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(1)
    config = ServerConfig(
        index=args.index,
        num_servers=args.num_servers,
        bind=args.bind,
        listen_fd=args.listen_fd,
        checkpoint_dir=args.checkpoint_dir or _default_checkpoint_dir(),
        limits=WireLimits(max_payload=int(args.max_payload_mb * (1 << 20))),
    )
    try:
        server = ParameterServerProcess(config, _secret_from_hex(secret_hex))
    except ValueError as error:  # a checkpoint that does not load
        print(f"loom.ps.server[{config.index}]: {error}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
