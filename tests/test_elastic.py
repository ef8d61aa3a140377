"""Elastic restarts: SIGKILL one worker under ``loom run --max-restarts 2``; the job resumes and finishes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_launcher import run_loom, wait_until_gone

from loom.checkpoint import checkpoint_name, list_checkpoints

pytestmark = pytest.mark.system

SCRIPT = Path(__file__).parent / "workers" / "elastic_train.py"


def records(stdout: str) -> list[dict]:
    """The JSON result lines, from raw or ``[rankN]: ``-prefixed output, in rank order."""
    found = [json.loads(line[line.index("{") :]) for line in stdout.splitlines() if "{" in line]
    return sorted(found, key=lambda r: r["rank"])


def event(times: Path, name: str) -> tuple[float, str]:
    stamp, _, text = (times / name).read_text().partition(" ")
    return float(stamp), text


@pytest.mark.timeout(150)
def test_sigkilled_worker_is_restarted_and_resumes_from_the_last_checkpoint(tmp_path, workers):
    ckpt, times = tmp_path / "ckpt", tmp_path / "times"
    times.mkdir()
    kill_at = 8  # checkpoints every 3 steps: the last one before the kill is step 6
    result = run_loom(
        [
            "run",
            "-n",
            2,
            "--max-restarts",
            2,
            "--run-dir",
            tmp_path / "run",
            SCRIPT,
            ckpt,
            12,
            kill_at,
            times,
        ],
        tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert wait_until_gone(str(SCRIPT)) == []
    finished = records(result.stdout)
    assert [(r["rank"], r["attempt"], r["steps"], r["resumed_from"]) for r in finished] == [
        (0, 1, 12, 6),
        (1, 1, 12, 6),
    ]
    killed_at, killed_step = event(times, "killed")
    stopped_at, how = event(times, "survivor_stopped")
    resumed_at, resumed_step = event(times, "resumed")
    steps_lost = int(killed_step) - int(resumed_step)
    print(
        f"elastic: SIGKILL at step {int(killed_step) + 1}; survivor stopped after {stopped_at - killed_at:.2f} s "
        f"({how}); training resumed from step {resumed_step} after {resumed_at - killed_at:.2f} s; "
        f"steps lost {steps_lost} (checkpoint every 3)"
    )
    assert 0 <= steps_lost < 3
    # Stopped by the launcher when its peer died, not by the watchdog: that would take the default hang timeout
    # (180 s). Half of it as the bound: no load stretches the ~1-2 s this takes here that far.
    assert stopped_at - killed_at < 90, stopped_at - killed_at
    # The launcher says what it did: the restart (who, how, which attempt), the resume, and a summary at the end.
    restart = [line for line in result.stderr.splitlines() if "restarting the worker group" in line]
    assert len(restart) == 1, result.stderr[-3000:]
    assert "worker rank 1 was killed by SIGKILL" in restart[0]
    assert "attempt 2 of 3 (logs/attempt_1; --max-restarts 2)" in restart[0]  # the attempt's log folder
    assert "loom.fit: resumed from the checkpoint of step 6" in result.stdout + result.stderr
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("loom run: finished in ") and "2 worker(s), 1 restart(s), 12 steps" in summary

    # The reference: fresh workers, no failure, resumed from a copy of the same checkpoint (step 6).
    reference_dir = tmp_path / "reference"
    shutil.copytree(ckpt / checkpoint_name(6), reference_dir / checkpoint_name(6))
    assert list(list_checkpoints(reference_dir)) == [6]
    (tmp_path / "times2").mkdir()
    reference = records(
        "".join(workers("elastic_train.py", 2, str(reference_dir), "12", "0", str(tmp_path / "times2")))
    )
    assert [(r["steps"], r["resumed_from"]) for r in reference] == [(12, 6), (12, 6)]
    for got, want in zip(finished, reference, strict=True):
        assert got["params"] == want["params"], f"rank {got['rank']} differs from the resumed reference"
