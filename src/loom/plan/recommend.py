"""Rank the predictions, say why, and write them: the table, the JSON file, the strategy line to paste.

Ranked by predicted samples per second among the configurations that fit ``--memory-per-proc``, then those that
do not fit, then those not predicted; each with its reason (`_why`: for a slower one, what costs it the most).
Each family also carries the error of its last ``--verify`` on this host (`last_errors`), kept in
``$LOOM_CACHE_DIR`` (default ``~/.cache/loom``), ``plan-verified-<host>.json``, beside loom's all-reduce
calibration.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.checkpoint.durable import replace_durable
from loom.plan.cost import Prediction

__all__ = [
    "MEMORY_MARGIN",
    "Ranked",
    "last_errors",
    "needed_per_process",
    "rank",
    "record_errors",
    "render",
    "to_json",
]


@dataclass(frozen=True)
class Ranked:
    prediction: Prediction
    feasible: bool
    reason: str
    last_error: float | None = None
    """The relative step-time error of this family's last verification on this host (None: never verified)."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _why(p: Prediction, top: Prediction) -> str:
    """Why ``p`` ranks where it does among the configurations that fit: the top's why it wins, a slower one's what
    costs it the most (``bubble`` past a fifth of its step, ``link-bound`` past its compute, else the larger of its
    communication and the rest)."""
    if p is top:
        return (f"fastest predicted: {p.samples_per_s:.1f} samples/s (compute {p.compute_s * 1e3:.1f} ms, "
                f"communication {p.comm_s * 1e3:.1f} ms on the critical path)")  # fmt: skip
    slower = f"{p.step_time_s / top.step_time_s - 1:.0%} slower than the top"
    if p.bubble > 0.2:
        return f"{slower}: pipeline bubble {p.bubble:.0%} of the step"
    if p.comm_s > p.compute_s:
        return f"{slower}: link-bound (communication {p.comm_s * 1e3:.1f} ms > compute {p.compute_s * 1e3:.1f} ms)"
    rest = p.step_time_s - p.compute_s - p.comm_s
    if p.comm_s >= rest:
        return f"{slower}: {p.comm_s * 1e3:.1f} ms of communication on the critical path"
    return f"{slower}: {rest * 1e3:.1f} ms of optimizer and step overhead"


def _apart(p: Prediction) -> str:
    """The clause a LocalSGD or DiLoCo reason ends with: the ranking is by speed, their training is not one process's."""
    if p.config.family not in ("LocalSGD", "DiLoCo"):
        return ""
    return f"; replicas average every {p.config.option('sync_every')} steps: not equal to one process"


MEMORY_MARGIN = 0.05
"""A "fits" verdict leaves this much of the limit unused: the predicted peak's error bound (`docs/plan.md`: never
under-predicted by more than 5 %), so that a configuration that fits does not run out of memory."""


def needed_per_process(p: Prediction, job_share: int = 0) -> int:
    """The memory per process a "fits" verdict for ``p`` asks of ``--memory-per-proc`` (`rank`)."""
    return int((p.memory["total"] + job_share) * (1 + MEMORY_MARGIN))


def rank(
    predictions: list[Prediction],
    memory_limit: int | None,
    errors: dict[str, float] | None = None,
    job_share: int = 0,
) -> list[Ranked]:
    """Order and explain ``predictions`` (the module docstring). A configuration fits ``memory_limit`` when its
    predicted peak per process plus ``job_share`` (each worker's share of the launcher's and the zygote's own
    memory, measured by the calibration), with `MEMORY_MARGIN` on top, is at most the limit: ``N`` processes
    with the limit each hold the job."""
    errors = errors or {}
    limit = math.inf if memory_limit is None else memory_limit
    fits = [p for p in predictions if not p.refused and needed_per_process(p, job_share) <= limit]
    fits.sort(key=lambda p: -p.samples_per_s)
    out = [Ranked(p, True, _why(p, fits[0]) + _apart(p), errors.get(p.config.family)) for p in fits]
    big = [p for p in predictions if not p.refused and p not in fits]
    for p in sorted(big, key=lambda p: p.memory["total"]):
        why = (f"does not fit: needs {_gib(needed_per_process(p, job_share))} per process (with its share of the "
               f"launcher's and a {MEMORY_MARGIN:.0%} margin) > --memory-per-proc {_gib(memory_limit or 0)}")  # fmt: skip
        out.append(Ranked(p, False, why + _apart(p), errors.get(p.config.family)))
    out += [Ranked(p, False, p.refused) for p in predictions if p.refused]
    return out


def to_json(ranked: list[Ranked], extra: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document: every configuration, ranked, with the fields the issue lists."""
    rows = []
    for i, r in enumerate(ranked, 1):
        p = r.prediction
        predicted = not p.refused
        rows.append({
            "rank": i, "family": p.config.family, "strategy": p.config.strategy, "launch": p.config.launch,
            "step_time_s": p.step_time_s if predicted else None,
            "samples_per_s": p.samples_per_s if predicted else None,
            "memory_bytes_per_process": p.memory if predicted else None,
            "wire_bytes_per_step": p.wire_bytes if predicted else None,
            "bubble": p.bubble, "feasible": r.feasible, "reason": r.reason,
            "last_verified_error": r.last_error,
        })  # fmt: skip
    return {**extra, "configurations": rows}


def render(ranked: list[Ranked], title: str) -> Any:
    """A rich table of ``ranked``; its text is escaped, not read as rich markup (a script argument may hold ``[``)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title), title_justify="left")
    for name, justify in (("#", "right"), ("strategy", "left"), ("loom run", "left"), ("step ms", "right"),
                          ("samples/s", "right"), ("memory/proc", "right"), ("wire/step", "right"),
                          ("last err", "right"), ("why", "left")):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for i, r in enumerate(ranked, 1):
        p = r.prediction
        err = f"{r.last_error:+.0%}" if r.last_error is not None else "-"
        if p.refused:
            table.add_row(
                str(i), escape(p.config.strategy), p.config.launch, "-", "-", "-", "-", err, escape(r.reason)
            )
            continue
        table.add_row(
            str(i), escape(p.config.strategy), p.config.launch, f"{p.step_time_s * 1e3:.1f}", f"{p.samples_per_s:.1f}",
            _gib(p.memory["total"]), _gib(p.wire_bytes), err, escape(r.reason), style=None if r.feasible else "dim",
        )  # fmt: skip
    return table


def _errors_path() -> Path:
    root = os.environ.get("LOOM_CACHE_DIR") or Path.home() / ".cache" / "loom"
    return Path(root) / f"plan-verified-{socket.gethostname()}.json"


def _recorded() -> dict[str, Any]:
    """The record of the last verifications ({} when there is none, or it is not a small JSON object)."""
    try:
        path = _errors_path()
        data = json.loads(path.read_text()) if path.stat().st_size <= 1 << 20 else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def last_errors() -> dict[str, float]:
    """Each family's step-time error at its last verification on this host (bounded read: a small file)."""
    try:
        return {str(k): float(v["error"]) for k, v in _recorded().items()}
    except (ValueError, TypeError, KeyError):
        return {}


def record_errors(errors: dict[str, float]) -> None:
    """Keep ``errors`` (family: relative step-time error) as the families' last verification."""
    path, data = _errors_path(), _recorded()
    for family, error in errors.items():
        data[family] = {"error": error, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with contextlib.suppress(OSError):  # a plan without its record is still a plan; the next verify writes it
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_durable(path, json.dumps(data, indent=1).encode())
