"""A rank stuck outside any collective is named with its Python stack (issue 25, item 1).

Waiting for a rank at its own work is right (rank-0-only evaluation, a checkpoint), so the others wait up to the
work timeout; but once they have waited past the hang timeout, the launcher's output shows where that rank is:
its stack, every thread, printed by its own watchdog thread when the waiting ranks ask through the store.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import WORKERS
from test_ps_launch import session_members


@pytest.mark.system
@pytest.mark.timeout(150)
def test_a_rank_stuck_in_its_own_code_shows_its_stack_then_the_work_timeout_stops_the_job(tmp_path):
    env = dict(
        os.environ, LOOM_WORK_TIMEOUT_S="12"
    )  # the stack comes at the hang timeout (3 s): 9 s to spare
    command = [sys.executable, "-m", "loom.cli", "run", "-n", "2", "--run-dir", str(tmp_path / "run"),
               str(WORKERS / "stuck_rank.py")]  # fmt: skip
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=130)
    finally:
        for pid in session_members(proc.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, output[-3000:]
    announced = [line for line in output.splitlines() if "outside any collective: their own work" in line]
    assert len(announced) == 1 and "rank(s) [1]" in announced[0], output[-3000:]
    assert "LOOM_HANG_TIMEOUT_S" in announced[0] and "LOOM_WORK_TIMEOUT_S" in announced[0]
    stack = output[output.index("loom watchdog: rank 1 is outside any collective") :]
    assert "stuck_in_its_own_code" in stack and "stuck_rank.py" in stack, output[-3000:]
    assert "longer than the work timeout" in output, output[-3000:]
    assert "same messages in the same order" not in output, output[-3000:]  # not the shm barrier's raw error


@pytest.mark.unit
def test_the_shared_memory_waits_give_way_to_the_watchdogs_work_timeout(monkeypatch):
    """Both stopped a stuck rank's job at 1800 s and the shared-memory wait, looking 10 times a second, won with
    a raw RuntimeError and a wrong HINT: a watchdog now keeps that wait open past its own work timeout."""
    from loom.comm import shm_wait
    from loom.fault.watchdog import WORK_REPORT_SLACK_S, Watchdog

    monkeypatch.setattr(shm_wait, "TIMEOUT_S", 1800.0)
    wd = Watchdog(rank=0, world_size=2, timeout_s=5, work_timeout=1800.0)
    assert shm_wait.TIMEOUT_S >= wd.work_timeout_s + WORK_REPORT_SLACK_S > wd.work_timeout_s + 10 * wd.poll_s
    Watchdog(rank=0, world_size=2, timeout_s=5, work_timeout=3.0)
    assert shm_wait.TIMEOUT_S >= 1800.0 + WORK_REPORT_SLACK_S  # never lowered below a watchdog's
