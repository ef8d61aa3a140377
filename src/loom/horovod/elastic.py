"""Horovod's elastic API (`run`, `State`, `ObjectState`, `TorchState`, `ElasticSampler`) on loom's restarts.

Horovod keeps the surviving processes when a worker dies; loom restarts the whole worker group (``loom run
--max-restarts N``). So rank 0 also writes each `commit()` to disk (one safetensors file, replaced atomically;
no pickle), and `run` starts each attempt from the last commit, broadcast from rank 0 (`State.sync`); work
since then is redone, as in Horovod. Commits go to ``$LOOM_HOROVOD_STATE_DIR``, else
``$LOOM_RUN_DIR/horovod_elastic`` (``loom run`` sets it), else memory only. `State.check_host_updates` never
interrupts: hosts joining a running job are the launcher's business.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from loom.checkpoint.durable import replace_durable
from loom.errors import CheckpointError
from loom.horovod import basics
from loom.horovod._objects import decode, encode
from loom.horovod.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run", "state_dir"]

_COMMIT = "commit.safetensors"


def state_dir() -> Path | None:
    if os.environ.get("LOOM_HOROVOD_STATE_DIR"):
        return Path(os.environ["LOOM_HOROVOD_STATE_DIR"])
    if os.environ.get("LOOM_RUN_DIR"):
        return Path(os.environ["LOOM_RUN_DIR"]) / "horovod_elastic"
    return None


class State:
    """What an elastic job keeps: `commit` it at safe points; `run` restores it after a restart."""

    def __init__(self) -> None:
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp=None, update_res=None) -> None:
        pass

    def commit(self) -> None:
        """Snapshot the state (in memory and, on rank 0, on disk) so a restarted job resumes from here."""
        self.save()
        directory = state_dir()
        if directory is not None and basics.rank() == 0:
            _write_commit(directory, self._snapshot_payload())
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises `HostsUpdatedInterrupt` here when hosts changed; loom restarts instead, so never."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        pass

    def _snapshot_payload(self):
        raise NotImplementedError

    def _load_payload(self, payload) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain values (``epoch=0, batch=0``), kept as attributes; synced with `broadcast_object`."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self._keys = list(kwargs)
        for key, value in kwargs.items():
            setattr(self, key, value)
        self._saved = self._values()

    def _values(self) -> dict:
        return {k: copy.deepcopy(getattr(self, k)) for k in self._keys}

    def save(self) -> None:
        self._saved = self._values()

    def restore(self) -> None:
        for key, value in self._saved.items():
            setattr(self, key, copy.deepcopy(value))

    def sync(self) -> None:
        if self._keys:
            values = broadcast_object(self._values(), root_rank=0, name="elastic.object_state")
            for key, value in values.items():
                setattr(self, key, value)
            self.save()

    def _snapshot_payload(self):
        return {"objects": self._saved}

    def _load_payload(self, payload) -> None:
        self._saved = payload["objects"]
        self.restore()


class TorchState(ObjectState):
    """A model, an optimizer and other values (samplers: anything with ``state_dict``/``load_state_dict``)."""

    def __init__(self, model=None, optimizer=None, **kwargs) -> None:
        self.model, self.optimizer = model, optimizer
        self._stateful = {k: v for k, v in kwargs.items() if hasattr(v, "state_dict")}
        plain = {k: v for k, v in kwargs.items() if k not in self._stateful}
        for key, value in self._stateful.items():
            setattr(self, key, value)
        super().__init__(**plain)

    def _handlers(self) -> dict:
        given = {"model": self.model, "optimizer": self.optimizer}
        return {**self._stateful, **{k: v for k, v in given.items() if v is not None}}

    def save(self) -> None:
        super().save()
        self._saved_states = {k: _clone(h.state_dict()) for k, h in self._handlers().items()}

    def restore(self) -> None:
        super().restore()
        for key, handler in self._handlers().items():
            if key in getattr(self, "_saved_states", {}):
                handler.load_state_dict(_clone(self._saved_states[key]))

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for key, handler in self._stateful.items():
            handler.load_state_dict(broadcast_object(handler.state_dict(), 0, name=f"elastic.{key}"))
        super().sync()

    def _snapshot_payload(self):
        return {"objects": self._saved, "states": self._saved_states}

    def _load_payload(self, payload) -> None:
        self._saved_states = payload["states"]
        super()._load_payload(payload)


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone(v) for v in tree)
    return copy.deepcopy(tree)


def _write_commit(directory: Path, payload) -> None:
    """The payload as one safetensors file (its tensors; the rest, `loom.horovod._objects`' JSON, in the metadata),
    replaced atomically, so a reader sees the previous commit or this one, whole. Tensors are cloned: safetensors
    refuses tensors that share memory (tied weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    tree, tensors = encode(payload)
    named = {str(i): t.clone() for i, t in enumerate(tensors)}  # encode made them contiguous, on the CPU
    replace_durable(directory / _COMMIT, save(named, metadata={"tree": json.dumps(tree)}))


def _read_commit(directory: Path):
    path = directory / _COMMIT
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as f:
        tree = (f.metadata() or {}).get("tree")
        if tree is None:
            raise CheckpointError(f"{path} is not a loom.horovod commit (no 'tree' in its metadata: an older "
                                  f"loom's?). HINT: delete {directory}/commit.* to start from the beginning")  # fmt: skip
        return decode(json.loads(tree), [f.get_tensor(str(i)) for i in range(len(f.keys()))])


def run(func):
    """Decorate ``train(state, ...)``: each attempt starts from the last commit, broadcast from rank 0; on a
    restart (``loom run --max-restarts``) the reset callbacks run first, as Horovod runs them after a reset."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not basics.is_initialized():
            raise ValueError("Horovod has not been initialized; use hvd.init() before hvd.elastic.run.")
        directory = state_dir()
        if directory is not None and basics.rank() == 0:
            payload = _read_commit(directory)
            if payload is not None:
                state._load_payload(payload)
        state.sync()
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0:
            state.on_reset()
        return func(state, *args, **kwargs)

    return wrapper


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's elastic sampler: shards what is left of this epoch's order over the current workers.
    ``record_batch`` counts a batch as processed on every rank; its ``state_dict`` (epoch, processed count)
    goes into a `TorchState` commit, so a restarted job skips what was done."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.processed_num += batch_size * self.num_replicas

    def reset(self) -> None:
        self.num_replicas = basics.size() if basics.is_initialized() else 1
        self.rank = basics.rank() if basics.is_initialized() else 0
        n = len(self.dataset)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=generator).tolist() if self.shuffle else list(range(n))
        remaining = order[min(self.processed_num, n) :]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        self.indices = remaining[self.rank :: self.num_replicas]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.processed_num = int(state["epoch"]), int(state["processed_num"])
        self.reset()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
