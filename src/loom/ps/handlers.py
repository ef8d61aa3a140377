"""What a parameter server does with each request: `RequestHandlers`, the models it holds and their checkpoints.

Every frame the server process (`loom.ps.server`) admits comes here, to the handler of its message type. A request
that must wait (a ``sync`` push until every worker has pushed that step, an ``ssp`` pull until the slowest worker
is close enough) is parked and answered later, so one slow worker never blocks the loop; `RequestHandlers._tick`
looks at the parked requests again when no message arrives.

Checkpoints, so that a server can die: with a checkpoint directory a model is saved when it is created (INIT) or
restored (RESTORE), on request (SAVE), at shutdown, and on its workers' schedule (`ParameterServerConfig`'s
``checkpoint_every`` and ``checkpoint_interval_s``). A sync step is saved *before* its replies go out
(write-ahead): a restarted server is never behind what a worker has seen, so only the step in flight is repeated;
in async/ssp the updates since the last save are lost (HELLO answers with the version each model resumed at).
Li et al. 2014 replicate shards on neighbouring servers to lose nothing; loom does not. `loom.fit`'s checkpoints
do not use these files: they go through STATE and RESTORE.
"""

from __future__ import annotations

import abc
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError

from loom.ps.plan import Piece
from loom.ps.shard import ModelShard, ShardSettings
from loom.ps.wire import DropCounters, Frame, MessageType

if TYPE_CHECKING:
    from loom.ps.server_config import ServerConfig

__all__ = ["RequestHandlers"]

_NAMESPACE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


def _plan_key(pieces) -> list[tuple[int, str, int, int]]:
    """What two plans must share for one model's pieces to be interchangeable."""
    return sorted((p.id, p.name, p.start, p.stop) for p in pieces)


@dataclass
class _Parked:
    identity: bytes
    frame: Frame
    worker: int
    clock: int


class RequestHandlers(abc.ABC):
    """The models a server holds, their checkpoints and the requests on them;
    `loom.ps.server.ParameterServerProcess` supplies the transport (`_reply`, `_error`)."""

    config: ServerConfig
    counters: DropCounters
    models: dict[str, ModelShard]
    failed: dict[str, str]
    """Per model, why its sync step failed (every request on it is answered with this until a worker rejoins)."""
    parked_pulls: dict[str, dict[int, _Parked]]
    parked_pushes: dict[str, dict[int, dict[int, _Parked]]]
    restore_tokens: dict[str, list[str]]
    """Per model, the tokens of the last RESTOREs applied (a repeat is answered, not applied again)."""

    @abc.abstractmethod
    def _reply(self, identity: bytes, frame: Frame, meta: dict[str, Any], tensors=None) -> None: ...

    @abc.abstractmethod
    def _error(self, identity: bytes, frame: Frame, message: str) -> None: ...

    # -- the log and the checkpoints ----------------------------------------------------------------------------
    def log(self, text: str) -> None:
        print(f"loom.ps.server[{self.config.index}]: {text}", flush=True)

    @property
    def shard_dir(self) -> Path | None:
        base = self.config.checkpoint_dir
        return None if base is None else base / f"server{self.config.index}"

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
        """Save ``shard`` if its schedule says so (the module docstring)."""
        settings = shard.settings
        if not shard.unsaved or self.shard_dir is None:
            return
        by_count = 0 < settings.checkpoint_every <= shard.unsaved
        interval = max(settings.checkpoint_interval_s, 20.0 * shard.save_seconds)
        by_time = settings.checkpoint_interval_s > 0 and now - shard.saved_at >= interval
        if by_count or by_time:
            self._save_shard(shard)

    def _model(self, frame: Frame) -> tuple[str, ModelShard, int]:
        name = frame.meta.get("ns")
        if not isinstance(name, str) or name not in self.models:
            raise ValueError(f"model {name!r} was not initialized on this server. HINT: call setup() first")
        if name in self.failed:
            raise RuntimeError(self.failed[name])
        shard = self.models[name]
        worker: Any = frame.meta.get("worker")
        shard.clocks.check_worker(worker)  # an int in range, or ValueError
        if shard.clocks.seen(worker, time.monotonic()):
            self.log(f"model {name!r}: worker {worker} is back")
        return name, shard, worker

    # -- handlers: `_<message type>` (`loom.ps.server.ParameterServerProcess.handle` finds them by name) -------
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
        """Grant a pull; without the values when the worker holds this version already (its push's reply
        carried them: ``have``), so pulling after each push costs no second copy."""
        slowest = shard.clocks.grant(parked.worker, parked.clock)
        meta = {"version": shard.version, "slowest": slowest}
        held = parked.frame.meta.get("have") == shard.version
        self._reply(parked.identity, parked.frame, meta, None if held else shard.dense_values())

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
            self._reply(identity, frame, {"version": shard.version, "staleness": 0, "duplicate": True},
                        _values_if_asked(frame, shard))  # fmt: skip
            return
        parked = _Parked(identity, frame, worker, clock)
        if shard.settings.mode == "sync":
            self.parked_pushes.setdefault(name, {}).setdefault(clock, {})[worker] = parked
            self._complete_sync(name, shard)
            return
        if _flag(frame):  # a non-finite loss or gradient: the worker sent its flag, not its update
            shard.clocks.pushed(worker, clock)
            self._reply(identity, frame, {"version": shard.version, "staleness": 0,
                                          "flags": [[worker, _flag(frame)]]}, _values_if_asked(frame, shard))  # fmt: skip
            self._release_pulls(name, shard)
            return
        staleness = max(0, shard.version - int(frame.meta["version"]))  # < 0 after a restart behind it
        shard.apply([frame.tensors], frame.meta.get("lrs"))
        shard.clocks.pushed(worker, clock)
        shard.record_staleness(staleness)
        self._after_update(shard)
        self._reply(identity, frame, {"version": shard.version, "staleness": staleness},
                    _values_if_asked(frame, shard))  # fmt: skip
        self._release_pulls(name, shard)

    def _complete_sync(self, name: str, shard: ModelShard) -> None:
        steps = self.parked_pushes.get(name, {})
        for clock in sorted(steps):
            waiting = steps[clock]
            if not set(shard.clocks.active()) <= set(waiting):
                return
            order = sorted(waiting)
            frames = [waiting[w].frame for w in order]
            staleness = [max(0, shard.version - int(f.meta["version"])) for f in frames]
            # A step any worker flagged non-finite is applied nowhere: every worker is told whose flag it was.
            flags = [[w, _flag(f)] for w, f in zip(order, frames, strict=True) if _flag(f)]
            if not flags:
                shard.apply([f.tensors for f in frames], frames[0].meta.get("lrs"))
            loss_sum = sum(float(f.meta.get("loss_sum", 0.0)) for f in frames)
            for w, stale in zip(order, staleness, strict=True):
                shard.clocks.pushed(w, clock)
                shard.record_staleness(stale)
            if not flags:
                self._after_update(shard)
            for w, frame, stale in zip(order, frames, staleness, strict=True):
                meta = {"version": shard.version, "staleness": stale, "loss_sum": loss_sum, "flags": flags}
                self._reply(waiting[w].identity, frame, meta, _values_if_asked(frame, shard))
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

    def _restore(self, identity: bytes, frame: Frame) -> None:
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

    def _answer_waiting(self, name: str, message: str, pulls: bool = True) -> None:
        """Answer the pushes (and ``pulls``) of model ``name`` still parked with an error: nobody is left
        waiting for them."""
        answered = list(self.parked_pulls.pop(name, {}).values()) if pulls else []
        for waiting in self.parked_pushes.pop(name, {}).values():
            answered.extend(waiting.values())
        for parked in answered:
            self._error(parked.identity, parked.frame, message)

    # -- time -------------------------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        for shard in self.models.values():
            self._save_if_due(shard, now)  # updates left unsaved when the pushes stopped
        for name, shard in self.models.items():
            if name in self.failed or shard.settings.mode == "async":
                continue
            pushes = self.parked_pushes.get(name, {})
            if shard.settings.mode == "sync" and not pushes:
                continue  # in sync a silence only matters while a step waits for it
            waiting = frozenset(self.parked_pulls.get(name, {})).union(*pushes.values())
            for worker in shard.clocks.expire(now, waiting):
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
        self._answer_waiting(name, message, pulls=False)


def _values_if_asked(frame: Frame, shard: ModelShard) -> dict[str, Any] | None:
    """A push's reply carries the parameters after the update when the worker asks (``pull``): its model then
    holds them when its step returns, at no extra round trip (`loom.parallel.ps.parameter_server`)."""
    return shard.dense_values() if frame.meta.get("pull") else None


def _flag(frame: Frame) -> float:
    """The non-finite flag a worker's push carries instead of its gradient (0: none, the push is an update)."""
    value = frame.meta.get("nonfinite", 0)
    return float(value) if isinstance(value, (int, float)) and value == value and value > 0 else 0.0


HANDLERS = {
    kind: getattr(RequestHandlers, f"_{kind.name.lower()}")
    for kind in MessageType
    if kind < MessageType.REPLY
}
"""Each request type's handler, fixed at import (a request type without one fails the import): these methods, and
no other, are reachable from a frame."""
