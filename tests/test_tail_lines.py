"""A worker's line reaches the launcher's output whole, however its write is cut (`loom.launch.tail_lines`)."""

from __future__ import annotations

import io
import threading
import time

import pytest

from loom.launch import tail_lines


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_line_written_in_pieces_comes_out_whole_with_one_header(tmp_path):
    log, out, finished = tmp_path / "0.out", io.StringIO(), threading.Event()
    log.write_text("")
    tailer = threading.Thread(
        target=tail_lines.tail_whole_lines, args=("[rank0]: ", str(log), out, finished, 0.01)
    )
    tailer.start()
    record = '{"a": [' + ", ".join(str(i) for i in range(600)) + "]}"
    with open(log, "a") as f:
        for piece in (record[:2172], record[2172:], "\nnext line\n", "no newline at the end"):
            f.write(piece)
            f.flush()
            time.sleep(
                0.2
            )  # the tailer reads each piece at the end of the file (torch's wrote each as a line)
    finished.set()
    tailer.join(timeout=10)
    assert out.getvalue().splitlines() == [
        f"[rank0]: {record}",
        "[rank0]: next line",
        "[rank0]: no newline at the end",
    ]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_line_that_stops_growing_is_written_after_the_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(tail_lines, "PARTIAL_WAIT_S", 0.1)
    log, out, finished = tmp_path / "0.out", io.StringIO(), threading.Event()
    log.write_text("progress 50%")
    tailer = threading.Thread(
        target=tail_lines.tail_whole_lines, args=("[rank0]: ", str(log), out, finished, 0.01)
    )
    tailer.start()
    deadline = time.monotonic() + 10
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.02)
    finished.set()
    tailer.join(timeout=10)
    assert out.getvalue() == "[rank0]: progress 50%\n"
