"""A worker's line reaches the launcher's output whole, with one prefix, however its write is cut
(`loom.launch.supervise.pump`, which reads the worker's pipe a line at a time)."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

from loom.launch.supervise import pump


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_line_written_in_pieces_comes_out_whole_with_one_prefix_and_in_the_log(tmp_path):
    read_end, write_end = os.pipe()
    out, log = io.StringIO(), tmp_path / "rank0.stdout.log"
    reader = threading.Thread(target=pump, args=(os.fdopen(read_end), "[rank0]: ", out, log))
    reader.start()
    record = '{"a": [' + ", ".join(str(i) for i in range(600)) + "]}"
    with os.fdopen(write_end, "w") as pipe:
        for piece in (record[:2172], record[2172:], "\nnext line\n", "no newline at the end"):
            pipe.write(piece)
            pipe.flush()
            time.sleep(0.2)  # each piece reaches the reader on its own
    reader.join(timeout=10)
    assert out.getvalue().splitlines() == [
        f"[rank0]: {record}",
        "[rank0]: next line",
        "[rank0]: no newline at the end",
    ]
    assert log.read_text() == f"{record}\nnext line\nno newline at the end"


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_recorded_exception_is_read_within_bounds_and_anything_else_is_none(tmp_path):
    from loom.launch.supervise import Worker, exception_of

    worker = Worker(0, None, tmp_path / "rank0.error.json", [])  # no process: only its error file is read
    assert exception_of(worker) is None  # no file
    for text in ("", "[1, 2]", '"a string"', '{"message": "x' + "y" * (2 << 20) + '"}'):
        worker.error_file.write_text(text)
        assert exception_of(worker) is None, text[:40]
    worker.error_file.write_text('{"message": {"message": "Traceback ...\\nValueError: bad lr 7"}}')
    assert exception_of(worker) == "ValueError: bad lr 7"


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_line_past_a_mib_is_copied_in_pieces_under_one_prefix(tmp_path):
    read_end, write_end = os.pipe()
    out = io.StringIO()
    reader = threading.Thread(target=pump, args=(os.fdopen(read_end), "[rank1]: ", out, tmp_path / "log"))
    reader.start()
    long = "x" * (3 << 20)
    with os.fdopen(write_end, "w") as pipe:
        pipe.write(f"{long}\nnext\n")
    reader.join(timeout=20)
    assert out.getvalue() == f"[rank1]: {long}\n[rank1]: next\n"
