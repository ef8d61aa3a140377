"""`loom plan` end to end on a tiny script: capture, profile, the calibration job, the ranked table and the JSON,
and ``--verify`` of the top 2 configurations under ``loom run`` (fresh processes: the system lane)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

TINY = str(Path(__file__).parent / "workers" / "plan_tiny.py")


def test_loom_plan_ranks_every_configuration_and_verifies_the_top_two(tmp_path):
    out = tmp_path / "plan.json"
    command = [sys.executable, "-m", "loom.cli", "plan", "-n", "2", "--verify", "--verify-top", "2", "--steps", "3",
               "--json", str(out), TINY, "--width", "256", "--depth", "3"]  # fmt: skip
    env = {**os.environ, "LOOM_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=850, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "chosen: fastest predicted" in done.stdout and "strategy = loom." in done.stdout
    doc = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"not plain JSON: {name}"))
    rows = doc["configurations"]
    families = {row["family"] for row in rows}
    assert {
        "DataParallel",
        "ShardedDataParallel",
        "ParameterServer",
        "LocalSGD",
        "DiLoCo",
        "Pipeline",
    } <= families
    feasible = [row for row in rows if row["feasible"]]
    assert feasible and feasible[0]["rank"] == 1
    assert all(row["step_time_s"] > 0 and row["memory_bytes_per_process"]["total"] > 0 for row in feasible)
    assert [r["samples_per_s"] for r in feasible] == sorted(
        (r["samples_per_s"] for r in feasible), reverse=True
    )
    # what the predictions were made of: the transport's table and the fixed costs, as the planner read them
    measured = doc["transport"]
    assert measured["world_size"] == 2 and len(measured["sizes"]) > 3
    assert measured["ps_fixed_s"] is not None and "stage3" in measured["fsdp_unit_s"]
    assert all(len(v) == len(measured["sizes"]) for v in measured["seconds"].values())
    verified = doc["verified"]
    assert [v["strategy"] for v in verified] == [row["strategy"] for row in feasible[:2]]
    # The persistent state is counted, not timed: within the 2 % (the shm segment rounds up its size).
    for v in verified:
        assert abs(v["measured_state_bytes"] / v["predicted_state_bytes"] - 1) <= 0.02, v
        assert v["measured_s"] > 0 and math.isfinite(v["error"])
    assert "predicted" in done.stdout and "measured" in done.stdout
    record = json.loads(next((tmp_path / "cache").glob("plan-verified-*.json")).read_text())
    assert {row["family"] for row in feasible[:2]} <= set(record)
