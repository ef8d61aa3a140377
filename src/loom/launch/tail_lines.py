"""Workers' log files to the launcher's output a whole line at a time (`torch.distributed.elastic`'s tailer).

``loom run`` (torch's agent) writes each worker's stdout and stderr to files and tails them into its own output,
each line after ``[rankN]: ``. torch's `tail_logfile` writes whatever it reads at the end of a file, so a line
read while its worker was still writing it came out in two pieces, each with the header (a JSON record split at
a page boundary no longer parses). `tail_whole_lines` holds a line back until its newline is in the file; a line left without one is written after
`PARTIAL_WAIT_S` of no growth (a prompt, a progress bar drawn with ``\\r``) and when the worker has finished.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from threading import Event
from typing import TextIO

__all__ = ["PARTIAL_WAIT_S", "install", "tail_whole_lines"]

PARTIAL_WAIT_S = 1.0
"""How long a line without its newline is held back while it does not grow."""


def tail_whole_lines(
    header: str, file: str, dst: TextIO, finished: Event, interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:  # fmt: skip
    """torch's `tail_logfile` with the same arguments, writing whole lines (see the module docstring)."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)
    pending, since = "", 0.0

    def emit(line: str) -> None:
        if log_line_filter is None or log_line_filter(line):
            dst.write(f"{header}{line}")

    with open(file, errors="replace") as fp:
        while True:
            chunk = fp.readline()
            if chunk:
                pending, since = pending + chunk, time.monotonic()
                if pending.endswith("\n"):
                    emit(pending)
                    pending = ""
                continue
            if finished.is_set():
                if pending:
                    emit(pending + "\n")
                return
            if pending and time.monotonic() - since > PARTIAL_WAIT_S:
                emit(pending + "\n")
                pending = ""
            time.sleep(interval_sec)


def install() -> None:
    """Make torch's `TailLog` (which looks `tail_logfile` up in its module at each start) use
    `tail_whole_lines`; in the launcher's process only."""
    from torch.distributed.elastic.multiprocessing import tail_log

    tail_log.tail_logfile = tail_whole_lines  # type: ignore[assignment]
