"""The launcher's record of its parameter servers' deaths: ``$LOOM_RUN_DIR/ps-servers.json``.

`loom.launch.servers` writes it (atomically) each time a server dies or is restarted; a worker whose request
times out reads it (`death_of`) to say why: the server died with this signal and was or was not restarted, rather
than guessing at the job secret. JSON only, read with a size bound.

Format: ``{"servers": [{"index", "address", "pid", "state", "restarts", "max_restarts", "deaths": [{"time",
"status", "cause", "restarted"}]}]}``; ``state`` is ``running``, ``dead`` (not restarted: past the limit) or
``stopped`` (at the end of the job); ``status`` is the exit status (negative: the signal), ``time`` Unix seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from loom.checkpoint.durable import replace_durable

__all__ = ["RECORD_NAME", "death_of", "write_record"]

RECORD_NAME = "ps-servers.json"
_MAX_BYTES = 1 << 20


def write_record(run_dir: Path, servers: list[dict[str, Any]]) -> None:
    """Replace the record in ``run_dir`` (a reader never sees half of it)."""
    replace_durable(run_dir / RECORD_NAME, json.dumps({"servers": servers}, indent=1).encode())


def death_of(index: int, since: float = 0.0) -> str | None:
    """What ``$LOOM_RUN_DIR``'s record says of server ``index`` when it is dead (``died at 12:03:04 (killed by
    SIGKILL) and was not restarted: ...``) or died after ``since`` (Unix seconds) and was restarted; None when
    there is no record or no such death (an older death, since restarted, does not explain a silence now)."""
    run_dir = os.environ.get("LOOM_RUN_DIR")
    if not run_dir:
        return None
    path = Path(run_dir) / RECORD_NAME
    try:
        if path.stat().st_size > _MAX_BYTES:
            return None
        servers = json.loads(path.read_text())["servers"]
        entry = next(s for s in servers if s["index"] == index)
        deaths, state = entry["deaths"], entry["state"]
        if not deaths or (state != "dead" and float(deaths[-1]["time"]) < since):
            return None
        last = deaths[-1]
        when = time.strftime("%H:%M:%S", time.localtime(float(last["time"])))
        text = f"died at {when} ({last['cause']})"
        if state == "dead":
            return (f"{text} and was not restarted: it died {len(deaths)} time(s), more than the launcher's "
                    f"--max-server-restarts {entry['max_restarts']}")  # fmt: skip
        restart = f"restart {entry['restarts']} of {entry['max_restarts']}"
        return f"{text} and was restarted ({restart}), but did not answer since"
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
