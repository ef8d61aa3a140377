"""A member stuck in its own code under healing (issue 37, item 3): its stacks are printed before it is replaced,
and the same rank stuck at the same place again stops the job naming it, instead of healing until the budget is
spent with no clue where."""

from __future__ import annotations

import re

import pytest
from test_heal import run_heal

from loom.launch.heal import HealPolicy, HealQuorum, JobStops, main_thread_place

DUMP = """Thread 0x00007f00000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/src/loom/fault/quorum.py", line 200 in _heartbeat

Current thread 0x00007f00000002 (most recent call first):
  File "/tmp/job/train.py", line 12 in stuck_in_its_own_code
  File "/tmp/job/train.py", line 30 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/src/loom/launch/worker.py", line 46 in _run
"""


@pytest.mark.unit
def test_the_place_is_the_innermost_frame_of_the_thread_that_runs_the_script():
    assert (
        main_thread_place(DUMP.splitlines()) == 'File "/tmp/job/train.py", line 12 in stuck_in_its_own_code'
    )
    assert main_thread_place(["no stack here"]) is None


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value


@pytest.mark.unit
def test_the_same_rank_stuck_at_the_same_place_twice_stops_the_job_naming_it():
    quorum = HealQuorum(
        3, HealPolicy(max_heals=9), _Store(), lambda r, g: None, lambda r: True, lambda r: None
    )
    quorum._count_stuck(1, "File a.py, line 3 in f")
    quorum._count_stuck(1, "File a.py, line 9 in g")  # elsewhere: not the same hang
    quorum._count_stuck(2, "File a.py, line 3 in f")  # another rank
    quorum._count_stuck(1, None)  # no stack had: never counted
    with pytest.raises(
        JobStops, match=r"worker rank 1 was stuck at the same place 2 times \(File a.py, line 3"
    ):
        quorum._count_stuck(1, "File a.py, line 3 in f")


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_member_stuck_in_its_own_code_shows_its_stack_and_a_repeat_stops_the_job(tmp_path):
    result, _out, _run_dir = run_heal(
        tmp_path, "", "--max-heals", "5", steps=40, timeout=280, HEAL_SCRIPT_FAULT="1:3:stuck",
        LOOM_HANG_TIMEOUT_S="6", LOOM_WORK_TIMEOUT_S="4",
    )  # fmt: skip
    # the guard's timeouts apply under heal (issue 39): the others' collective gives up at the hang timeout, and the
    # launcher waits the work timeout for the stuck member's check-in
    err = result.stderr
    (tmp_path / "launcher.stderr.log").write_text(err)  # all of it, for a failure
    assert result.returncode == 1, err[-4000:]
    killed = [line for line in err.splitlines() if "did not check in" in line]
    assert killed and all("stuck at File" in line and "stuck_in_its_own_code" in line for line in killed), (
        err[-4000:]
    )
    assert all("within 4 s (work_timeout_s / LOOM_WORK_TIMEOUT_S)" in line for line in killed), err[-4000:]
    # who did not arrive (issue 39): the others name rank 1 at the collective that timed out, and the launcher's
    # line says where rank 1 was among the epoch's collectives
    assert all(re.search(r", outside the collectives of epoch \d+ after #\d+ \('gradient all-reduce'\): dropped", line)
               for line in killed), killed  # fmt: skip
    assert re.search(
        r"step \d+ dropped: collective #\d+ of epoch \d+ \('gradient all-reduce'\) timed out after 6 s "
        r"\(hang_timeout_s / LOOM_HANG_TIMEOUT_S\); member\(s\) rank 1 did not arrive",
        err,
    ), err[-4000:]
    assert "[rank1]: " in err and "most recent call first" in err, "rank 1's stacks were not printed"
    assert "worker rank 1 was stuck at the same place 2 times" in err, err[-4000:]
    assert "heal 1 of 5" in err and "heal 2 of 5" not in err, err[-4000:]
