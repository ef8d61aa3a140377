"""What a healing worker tells the launcher through the job's store, as the launcher reads it: the guard's
timeouts (``guard/RANK/GEN``) and its place among its epoch's collectives (``at/RANK``), and the exit status of a
worker told to leave. Bounded readers of untrusted bytes, without torch (the launcher imports them; the worker's
side is `loom.fault.quorum`)."""

from __future__ import annotations

import json
import math
from typing import Any

from loom.errors import LeftOutOfQuorum

__all__ = ["GUARD_KEYS", "HEARTBEAT_S", "LEFT_OUT_STATUS", "read_guard", "read_place"]

HEARTBEAT_S = 0.5
"""Seconds between a healing worker's heartbeats (``hb/RANK/GEN``, sent by its watchdog thread:
`loom.fault.quorum.Quorum.beat`); the launcher's timeout is the liveness timeout (`Quorum.apply_guard`)."""

GUARD_KEYS = {
    "work_s": "work_timeout_s / LOOM_WORK_TIMEOUT_S",
    "liveness_s": "liveness_timeout_s / LOOM_LIVENESS_TIMEOUT_S",
}
"""What a worker tells the launcher in ``guard/RANK/GEN`` (JSON) -> the option each comes from."""


LEFT_OUT_STATUS = LeftOutOfQuorum.exit_status
"""The exit status of a worker told to leave the quorum (`LeftOutOfQuorum`; 75 is sysexits' EX_TEMPFAIL, "try
again"): the launcher replaces it as it does a killed worker, while any other non-zero status is the script's own
error and stops the job (`loom.launch.heal`)."""


def read_guard(raw: bytes) -> dict[str, float]:
    """A worker's ``guard/RANK/GEN`` (`Quorum.apply_guard`), as the launcher reads it: bounded, and only positive
    finite seconds under the known keys (anything else is ignored: heal's defaults apply)."""
    try:
        told = json.loads(raw[:256])
    except ValueError:
        return {}
    if not isinstance(told, dict):
        return {}
    return {k: float(v) for k, v in told.items() if k in GUARD_KEYS and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v) and v > 0}  # fmt: skip


def read_place(raw: bytes, epoch: int, generation: int) -> dict | None:
    """A member's ``at/RANK`` (`Quorum.place`) as a watchdog record of ``epoch`` for its process ``generation``:
    bounded and checked (None: unreadable). A record of another epoch or process says no collective of this one
    (it has not arrived at any)."""
    try:
        told = json.loads(raw[:1024])
    except ValueError:
        return None
    if not isinstance(told, dict) or not isinstance(told.get("time"), (int, float)):
        return None

    def op(value: Any) -> list | None:
        ok = isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
        ok = ok and type(value[1]) is int
        return [value[0][:80], value[1]] if ok else None

    if (told.get("epoch"), told.get("gen")) != (epoch, generation):
        return {"current": None, "done": None, "time": float(told["time"])}
    waiting = told.get("waiting_s")
    return {"current": op(told.get("current")), "done": op(told.get("done")), "time": float(told["time"]),
            "waiting_s": waiting if isinstance(waiting, (int, float)) else None}  # fmt: skip
