"""One model's pieces on one server: the values, the optimizer that updates them, and their checkpoint.

The server runs the user's optimizer *where the parameters live* (Li et al. 2014): ``torch.optim.<Type>`` is
rebuilt over this server's pieces with the user's param groups' hyperparameters, so its state (momentum, Adam
moments) is sharded exactly like the parameters. Pieces of embedding tables stay ``rows x width`` matrices and
receive sparse COO gradients, as ``nn.Embedding(sparse=True)`` produces in one process; dense pieces are flat.

Checkpoint files: ``DIR/<namespace>.json`` (plan, version, clocks, optimizer scalars) names its safetensors file
(values and optimizer tensors; a new name per save, so two saves at one version cannot pair one's JSON with the
other's tensors) and is replaced last, atomically: a crash while saving leaves the previous checkpoint intact.
Not fsynced: a checkpoint survives the server process, not the loss of the host's page cache (a power cut).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loom.ps.clocks import ClockTable
from loom.ps.plan import Piece

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ModelShard", "ShardSettings"]

ELEMENTWISE_OPTIMIZERS = (
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "SparseAdam",
    "Adamax",
    "NAdam",
    "RAdam",
)
"""Optimizers whose update of an element depends only on that element: exact on any cut of a parameter."""

_MAX_JSON_BYTES = 64 << 20
"""Largest checkpoint JSON read (plan, clocks and optimizer scalars; the tensors are in the safetensors file)."""


@dataclass(frozen=True)
class ShardSettings:
    """What the workers asked for when they set the model up (sent with INIT, kept in the checkpoint)."""

    mode: str
    staleness: int
    num_workers: int
    timeout_s: float
    checkpoint_every: int
    """Save after this many updates since the last save (0: not by count)."""
    optimizer: str
    groups: list[dict[str, Any]]
    """Hyperparameters of each optimizer param group (without ``params``)."""
    checkpoint_interval_s: float = 0.0
    """Save when the oldest unsaved update is this old (0: not by time); see `loom.ps.handlers`."""


class ModelShard:
    """The pieces of one model (a namespace) held by this server."""

    def __init__(
        self, name: str, settings: ShardSettings, pieces: list[Piece], values: dict[int, torch.Tensor]
    ):
        if settings.optimizer not in ELEMENTWISE_OPTIMIZERS:
            raise ValueError(
                f"optimizer {settings.optimizer} cannot run sharded; supported: {', '.join(ELEMENTWISE_OPTIMIZERS)}"
            )
        self.name = name
        self.settings = settings
        self.pieces = {p.id: p for p in pieces}
        self.params: dict[int, torch.Tensor] = {}
        for piece in pieces:
            value = values[piece.id].detach()
            shape = (piece.rows, piece.width) if piece.sparse else (piece.numel,)
            if value.numel() != piece.numel:
                raise ValueError(
                    f"piece {piece.id} of {piece.name!r} has {value.numel()} values, not {piece.numel}"
                )
            self.params[piece.id] = value.reshape(shape).clone().requires_grad_(True)
        self.optimizer = self._build_optimizer()
        self.version = 0
        self.clocks = ClockTable(settings.num_workers, settings.mode, settings.staleness, settings.timeout_s)
        self.staleness_histogram: dict[int, int] = {}
        self.unsaved = 0
        """Updates since the last save (the server's checkpoint schedule; not saved)."""
        self.saved_at = 0.0
        """``time.monotonic()`` of the last save, or of the first unsaved update after it."""
        self.save_seconds = 0.0
        """How long the last save took."""
        self.save_error: str | None = None
        """Why the last save failed (None: it did not)."""
        self.resumed_version: int | None = None
        """The version this shard was loaded at from its checkpoint file (None: not loaded from one)."""

    def _build_optimizer(self) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, self.settings.optimizer)
        groups = []
        self._group_index: list[int] = []
        """The user's param-group index of each group of the server's optimizer (groups without pieces here are
        left out)."""
        for index, hyper in enumerate(self.settings.groups):
            params = [self.params[i] for i in sorted(self.params) if self.pieces[i].group == index]
            if params:  # JSON made the tuples (Adam's betas) lists
                hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in hyper.items()}
                groups.append({"params": params, **hyper})
                self._group_index.append(index)
        if not groups:  # a server with no piece of this model (more servers than parameters)
            groups = [{"params": [torch.zeros(0, requires_grad=True)]}]
        return cls(groups)

    def check_learning_rates(self, lrs: Any) -> None:
        """Validate a push's ``lrs``: one finite number >= 0 per param group."""
        n = len(self.settings.groups)
        if not isinstance(lrs, list) or len(lrs) != n:
            raise ValueError(f"'lrs' must list one learning rate per param group ({n}), got {lrs!r}")
        for lr in lrs:
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr < float("inf"):
                raise ValueError(f"learning rate {lr!r} is not a finite number >= 0")

    # -- values -----------------------------------------------------------------------------------------------
    def dense_values(self) -> dict[str, torch.Tensor]:
        return {f"p{i}": t.detach() for i, t in self.params.items() if not self.pieces[i].sparse}

    def rows(self, requests: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Values of the requested rows: ``{"r<id>": local row indices}`` -> ``{"p<id>": rows x width}``."""
        out = {}
        for key, rows in requests.items():
            piece = self._piece(key, sparse=True)
            out[f"p{piece.id}"] = self.params[piece.id].detach().index_select(0, self._row_index(piece, rows))
        return out

    def _piece(self, key: str, sparse: bool | None = None) -> Piece:
        try:
            piece = self.pieces[int(key[1:])]
        except (ValueError, KeyError):
            raise ValueError(f"{key!r} names no piece of model {self.name!r} on this server") from None
        if sparse is not None and piece.sparse != sparse:
            raise ValueError(f"{key!r} is {'not ' if sparse else ''}a piece of a sparse table")
        return piece

    @staticmethod
    def _row_index(piece: Piece, rows: torch.Tensor) -> torch.Tensor:
        if rows.dtype != torch.int64 or rows.dim() != 1:
            raise ValueError(f"row indices of piece {piece.id} must be a 1-D int64 tensor")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= piece.rows):
            raise ValueError(f"row indices of piece {piece.id} are outside 0..{piece.rows - 1}")
        return rows

    # -- updates ----------------------------------------------------------------------------------------------
    def check_gradients(self, tensors: dict[str, torch.Tensor]) -> None:
        """Validate one worker's pushed gradients (names, shapes, dtypes, row ranges)."""
        for key, value in tensors.items():
            piece = self._piece(key)
            if key[0] == "r":
                self._row_index(piece, value)
                continue
            if key[0] != "g" or not value.is_floating_point():
                raise ValueError(f"{key!r} is not a floating-point gradient")
            if piece.sparse:
                rows = tensors.get(f"r{piece.id}")
                if rows is None or value.shape != (rows.numel(), piece.width):
                    raise ValueError(f"sparse gradient {key!r} does not match its row indices")
            elif value.numel() != piece.numel:
                raise ValueError(f"gradient {key!r} has {value.numel()} elements, the piece {piece.numel}")

    def apply(self, pushes: list[dict[str, torch.Tensor]], lrs: list[float] | None = None) -> None:
        """One optimizer step on the sum of ``pushes`` (summed in the order given; one push in async/ssp), at the
        learning rates ``lrs`` (``lrs[g]`` for the user's param group ``g``: a scheduler ran) when given."""
        if lrs is not None:
            self.check_learning_rates(lrs)
            for group, user_group in zip(self.optimizer.param_groups, self._group_index, strict=False):
                group["lr"] = float(lrs[user_group])
        for pid, param in self.params.items():
            piece = self.pieces[pid]
            grads = [p[f"g{pid}"] for p in pushes if f"g{pid}" in p]
            if piece.sparse:
                rows = [p[f"r{pid}"] for p in pushes if f"r{pid}" in p]
                if not rows or not sum(r.numel() for r in rows):
                    param.grad = None  # no row touched: nothing to update (as for an unused parameter)
                    continue
                index = torch.cat(rows).unsqueeze(0)
                param.grad = torch.sparse_coo_tensor(
                    index, torch.cat(grads).to(param.dtype), (piece.rows, piece.width)
                ).coalesce()
            elif grads:
                total = grads[0].to(param.dtype).reshape(param.shape).clone()
                for g in grads[1:]:
                    total += g.to(param.dtype).reshape(param.shape)
                param.grad = total
            else:
                param.grad = None
        self.optimizer.step()
        for param in self.params.values():
            param.grad = None
        self.version += 1

    def record_staleness(self, staleness: int) -> None:
        self.staleness_histogram[staleness] = self.staleness_histogram.get(staleness, 0) + 1

    def stats(self) -> dict[str, Any]:
        """Version, staleness histogram, clocks, the last granted pulls and the version this server process
        resumed at from its checkpoint (None: it was not restarted), for STATS and tests."""
        return {
            "version": self.version,
            "mode": self.settings.mode,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
            "max_lead": self.clocks.max_lead,
            "clocks": self.clocks.clocks,
            "status": self.clocks.status,
            "grants": self.clocks.grants[-2000:],
            "values": sum(t.numel() for t in self.params.values()),
            "resumed_version": self.resumed_version,
        }

    # -- checkpoint -------------------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Everything needed to continue exactly: JSON (plan, version, clocks, optimizer hyperparameters and
        scalars) and tensors (``piece.<id>`` values, ``opt.<idx>.<name>`` optimizer state). Used for the files
        of `save` and, over the wire, for the checkpoints of `loom.fit` (STATE / RESTORE)."""
        tensors = {f"piece.{i}": t.detach().contiguous() for i, t in self.params.items()}
        opt_state = self.optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for idx, state in opt_state["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"opt.{idx}.{key}"] = value.detach().contiguous()
                else:
                    scalars.setdefault(str(idx), {})[key] = value
        meta = {
            "name": self.name,
            "version": self.version,
            "settings": asdict(self.settings),
            "pieces": [p.to_json() for p in self.pieces.values()],
            "param_groups": opt_state["param_groups"],
            "optimizer_scalars": scalars,
            "clocks": self.clocks.state_dict(),
            "staleness_histogram": {str(k): v for k, v in self.staleness_histogram.items()},
        }
        return meta, tensors

    @staticmethod
    def from_state(
        meta: dict[str, Any], tensors: dict[str, torch.Tensor], settings: ShardSettings | None = None
    ) -> ModelShard:
        """The shard `state` described, named ``meta["name"]``, under ``settings`` (default: the saved ones).

        Raises `ValueError` for a state that does not fit together (missing or misshapen tensors, another
        optimizer or number of workers than ``settings``)."""
        try:
            saved = ShardSettings(**meta["settings"])
            settings = settings or saved
            kind = (saved.optimizer, saved.num_workers, len(saved.groups))
            if kind != (settings.optimizer, settings.num_workers, len(settings.groups)):
                raise ValueError(
                    f"the saved state is for {saved.optimizer} with {len(saved.groups)} param group(s) and "
                    f"{saved.num_workers} workers, this model has {settings.optimizer} with "
                    f"{len(settings.groups)} and {settings.num_workers}"
                )
            pieces = [Piece.from_json(p) for p in meta["pieces"]]
            values = {p.id: tensors[f"piece.{p.id}"] for p in pieces}
            shard = ModelShard(str(meta["name"]), settings, pieces, values)
            state: dict[int, dict[str, Any]] = {}
            for key, value in tensors.items():
                if key.startswith("opt."):
                    _, idx, name = key.split(".", 2)
                    state.setdefault(int(idx), {})[name] = value.clone()
            for idx, entries in meta["optimizer_scalars"].items():
                state.setdefault(int(idx), {}).update(entries)
            shard.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
            shard.version = int(meta["version"])
            shard.clocks.load_state_dict(meta["clocks"])
            shard.staleness_histogram = {int(k): int(v) for k, v in meta["staleness_histogram"].items()}
        except (KeyError, IndexError, TypeError, AttributeError) as error:  # a state that is not a shard's
            raise ValueError(
                f"not a parameter-server shard state ({type(error).__name__}: {error})"
            ) from None
        return shard

    def save(self, directory: Path) -> Path:
        """Write the checkpoint into ``directory`` (atomically: see the module docstring); returns its JSON."""
        directory.mkdir(parents=True, exist_ok=True)
        meta, tensors = self.state()
        weights = f"{self.name}.v{self.version}.{os.urandom(4).hex()}.safetensors"
        save_file(tensors, str(directory / (weights + ".tmp")))
        os.replace(directory / (weights + ".tmp"), directory / weights)
        target = directory / f"{self.name}.json"
        (directory / f"{self.name}.json.tmp").write_text(json.dumps({**meta, "weights": weights}, indent=1))
        os.replace(directory / f"{self.name}.json.tmp", target)
        # Older tensors, and the temporary file of a save a crash interrupted (one writer per folder).
        for old in [*directory.glob(f"{self.name}.v*.safetensors"), *directory.glob(f"{self.name}.v*.tmp")]:
            if old.name != weights:
                old.unlink(missing_ok=True)
        return target

    @staticmethod
    def load(path: Path) -> ModelShard:
        """The shard saved at ``path`` (its JSON). Raises `ValueError` naming the file for one that is not a
        shard checkpoint, or whose tensors file is missing."""
        try:
            if path.stat().st_size > _MAX_JSON_BYTES:
                raise ValueError(
                    f"it is {path.stat().st_size} bytes, more than a shard's ({_MAX_JSON_BYTES})"
                )
            meta = json.loads(path.read_text())
            weights = meta["weights"] if isinstance(meta, dict) else None
            if not isinstance(weights, str) or "/" in weights or not weights.endswith(".safetensors"):
                raise ValueError(f"its 'weights' entry is {weights!r}, not a safetensors file beside it")
            shard = ModelShard.from_state(meta, load_file(str(path.parent / weights)))
        except (OSError, ValueError, SafetensorError) as error:
            raise ValueError(
                f"{path} is not a loadable parameter-server checkpoint: {error}. HINT: delete the folder "
                f"{path.parent} to start the server without it"
            ) from None
        shard.resumed_version = shard.version
        return shard
