"""Parameter-server jobs through `loom run`: a SIGKILLed worker under ``--on-worker-failure continue``, and
under ``--max-restarts``.

async: the other workers finish every step, the launcher names the dead rank and exits 0, and no process of the
job is left. sync: ``continue`` is refused at start-up (a sync step needs every worker); with ``--max-restarts 1``
the group restarts and the workers continue from their clocks on the servers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import WORKERS
from torch import nn
from workers.common import least_squares

pytestmark = pytest.mark.system

LOOM = [sys.executable, "-m", "loom.cli"]
JOB = WORKERS / "ps_launch_job.py"


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[4]) == sid and fields[0] != "Z":  # fields after ")": state ppid pgrp session ...
            found.append(int(entry.name))
    return found


def run_job(
    tmp_path: Path, args: list[str], config: dict, timeout: float, job: Path = JOB
) -> tuple[int, str, str, list[int]]:
    """`loom run ARGS JOB CONFIG` (``ps_launch_job.py`` unless told) in its own session; returns (status,
    stdout, stderr, processes of the session still alive once the launcher has exited)."""
    command = [*LOOM, "run", *args, "--run-dir", str(tmp_path / "run"), str(job), json.dumps(config)]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err, session_members(proc.pid)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"loom run {args} did not finish within {timeout} s") from None
    finally:
        for pid in session_members(proc.pid):  # whatever happened, leave nothing behind
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def results(tmp_path: Path) -> dict[int, dict]:
    return {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (tmp_path / "run").glob("result-*.json")
    }


def first_batch_reference() -> dict[str, float]:
    """Loss and mean absolute error of the initial model on global batch 0, in one process."""
    from loom.data import GlobalBatchSampler

    x, y = least_squares().tensors  # the problem of workers/ps_launch_job.py
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    indices = next(iter(GlobalBatchSampler(256, 48, seed=1))).indices
    with torch.no_grad():
        out = model(x[indices])
    return {
        "loss": nn.functional.mse_loss(out, y[indices]).item(),
        "mae": (out - y[indices]).abs().mean().item(),
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_continue_a_killed_worker_does_not_stop_the_others(tmp_path, mode):
    """3 workers, rank 1 SIGKILLs itself before step 5 of 40; in ssp (staleness 1) the others wait for it until
    the 3 s worker timeout, and the server says so."""
    config = {"mode": mode, "steps": 40, "kill_rank": 1, "kill_step": 5, "slow_s": 0.02}
    if mode == "ssp":
        config.update(staleness=1, timeout_s=3.0)
    args = ["-n", "3", "--servers", "1", "--on-worker-failure", "continue"]
    started = time.monotonic()
    status, out, err, left = run_job(tmp_path, args, config, timeout=150)
    elapsed = time.monotonic() - started
    assert status == 0, err[-3000:]
    assert left == [], f"processes left after the launcher exited: {left}"
    assert "worker rank 1 was killed by SIGKILL; 2 other worker(s) go on" in err, err[-3000:]
    assert "2 of 3 workers finished" in err
    done = results(tmp_path)
    assert sorted(done) == [0, 2]
    reference = first_batch_reference()
    for rank, result in done.items():
        assert len(result["losses"]) == 40, rank
        assert f"[rank{rank}]: rank {rank} finished 40 steps" in out
        assert result["eval"] == pytest.approx(reference, abs=1e-5), rank  # global batch, eval on all 3
        staleness = result["staleness"]
        assert len(staleness) == 40 and all(s is not None and s >= 0 for s in staleness)
    assert max(r["losses"][-1] for r in done.values()) < 0.05 * done[0]["losses"][0]
    if mode == "ssp":
        assert "worker 1 silent for" in out and "ssp no longer waits for it" in out, out[-3000:]
    mean = sum(s for r in done.values() for s in r["staleness"]) / 80
    print(f"{mode} continue job: {elapsed:.1f} s, mean staleness of the survivors' updates {mean:.2f}")


@pytest.mark.timeout(180)
def test_continue_is_refused_at_start_up_for_a_sync_job(tmp_path):
    """A sync step needs every worker's push, so the survivors of a lost worker cannot finish (each step failed,
    naming the worker, once it was lost): --on-worker-failure continue is refused before any step (issue 25)."""
    config = {"mode": "sync", "steps": 20, "kill_rank": 1, "kill_step": 3, "timeout_s": 3.0}
    args = ["-n", "2", "--servers", "1", "--on-worker-failure", "continue"]
    status, out, err, left = run_job(tmp_path, args, config, timeout=150)
    assert status == 1, err[-3000:]
    assert left == []
    assert "SIGKILL" not in err  # refused before the step that would have killed rank 1
    assert ("failed (exit code 1): StartRefused: --on-worker-failure continue: "
            "ParameterServer(mode='sync') cannot go on without a lost worker") in err, err[-3000:]  # fmt: skip
    assert "every worker failed the same way (ranks [0, 1])" in err
    assert results(tmp_path) == {}


@pytest.mark.timeout(180)
def test_restarted_sync_job_continues_from_the_servers_clocks(tmp_path):
    """The elastic agent restarts the group; the workers rejoin the servers' model at their clock (3), so the
    servers apply all 10 steps of the new attempt instead of taking them for resent pushes."""
    config = {"mode": "sync", "steps": 10, "kill_rank": 1, "kill_step": 3}
    args = ["-n", "2", "--servers", "1", "--max-restarts", "1"]
    status, out, err, left = run_job(tmp_path, args, config, timeout=150)
    assert status == 0, err[-3000:]
    assert left == []
    done = results(tmp_path)
    assert sorted(done) == [0, 1]
    for result in done.values():
        assert result["attempt"] == 1 and len(result["losses"]) == 10
        assert result["clock"] == 13 and result["server_version"] == 13
    # The step records go where every strategy's do (`loom report` reads them), and the summary counts them.
    records = (tmp_path / "run" / "metrics" / "rank0.jsonl").read_text().splitlines()
    assert json.loads(records[-1])["step"] == 13
    assert ", 13 steps; " in err
