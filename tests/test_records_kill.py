"""Step records survive a kill: a rank SIGKILLed as it begins step K+1 has steps 1..K in its records file (the
whole step it finished, not the last buffered second: `loom.observe.metrics`), and every line is whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _kill_group

WORKERS = Path(__file__).parent / "workers"
SRC = Path(__file__).resolve().parents[1] / "src"
FINISHED = 5  # steps the killed rank finishes; it is killed as it begins the next


@pytest.mark.system
@pytest.mark.timeout(150)
def test_a_killed_rank_keeps_the_record_of_every_step_it_finished(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=f"{WORKERS}{os.pathsep}{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               LOOM_FAULTS=f"kill@1:{FINISHED + 1}:before", OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [sys.executable, "-m", "loom.cli", "run", "-n", "2", "--run-dir", str(run_dir),
           str(WORKERS / "records_kill.py"), "50"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    assert proc.returncode != 0, "the job went on although rank 1 was killed"
    lines = (run_dir / "metrics" / "rank1.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line whole
    steps = sorted({r["step"] for r in records})
    assert steps[:FINISHED] == list(range(1, FINISHED + 1)), (steps, stderr[-2000:])
    assert max(steps) == FINISHED  # the step it was killed in was never recorded
    finished = [r for r in records if r["step"] <= FINISHED]
    assert all(r["rank"] == 1 and r["time_s"] > 0 and "comm_s" in r for r in finished)
    # rank 0, stopped by the launcher while waiting for rank 1 in step FINISHED + 1, lost no finished step either
    survivor = {
        json.loads(line)["step"] for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()
    }
    assert set(range(1, FINISHED + 1)) <= survivor


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_record_line_is_the_json_of_its_fields():
    import math

    from loom.observe.metrics import json_line

    head = (3, 1, 0.012345678901, 32, 64, 0.6931471805599453, 1795811740.0050141)
    cases = [
        {"data_s": 1.1294e-05, "compute_s": 0.001107608123, "bytes_sent": 123456789, "bytes_received": 0},
        {"comm_s": 0.25, "skipped": True},  # a flag: not a number
        {"memory": {"parameters": 4, "state": 4}, "rss_bytes": 5},
        {"spread": float("inf"), "data_s": None},
        {},
    ]
    for extra in cases:
        for loss in (head[5], float("nan")):
            fields = (*head[:5], loss, head[6])
            line = json_line(fields[1], fields[0], *fields[2:], extra)
            assert line.endswith(b"\n") and line.count(b"\n") == 1
            got = json.loads(line)
            want = {"step": 3, "rank": 1, "time_s": fields[2], "samples": 32, "global_samples": 64, "loss": loss,
                    "wall": fields[6], **{k: v for k, v in extra.items() if v is not None}}  # fmt: skip
            assert got.keys() == want.keys()
            for key, value in want.items():
                if isinstance(value, float) and math.isfinite(value):
                    # measured floats to 7 significant digits, the wall clock to the microsecond, the loss exact
                    tolerance = 0 if key == "loss" else 1e-6 if key == "wall" else 5e-7 * abs(value)
                    assert abs(got[key] - value) <= tolerance, (key, got[key], value)
                elif isinstance(value, float):
                    assert math.isnan(got[key]) if math.isnan(value) else got[key] == value
                else:
                    assert got[key] == value and type(got[key]) is type(value)
