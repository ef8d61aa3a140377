"""A script's own error stops a healed job (issue 23): under ``--on-worker-failure heal`` a worker that exits
non-zero on its own (an uncaught exception: status 1 and a traceback) is a bug a replacement would repeat, so the
job stops at once naming the rank and the status; a worker the quorum told to leave (`LEFT_OUT_STATUS`) and one
killed by a signal are healed (tests/test_heal.py kills them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_heal import check_healed_job, reports, run_heal

from loom.fault.quorum import LEFT_OUT_STATUS
from loom.launch.heal import HealPolicy, HealQuorum, JobStops, exit_kind


class _Store:
    """The store calls `HealQuorum.died` makes."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value


@pytest.mark.unit
def test_a_signal_or_the_left_out_status_is_healed_any_other_status_stops_the_job():
    assert [exit_kind(s) for s in (0, -9, -6, LEFT_OUT_STATUS, 1, 2, 3)] == [
        "finished", "lost", "lost", "lost", "error", "error", "error"
    ]  # fmt: skip
    started: list[tuple[int, int]] = []
    quorum = HealQuorum(2, HealPolicy(max_heals=5), _Store(), lambda r, g: started.append((r, g)),
                        lambda r: True, lambda r: None)  # fmt: skip
    quorum.ended(1, -9, "worker rank 1 was killed by SIGKILL")
    quorum.ended(1, LEFT_OUT_STATUS, "worker rank 1 failed (exit code 75): LeftOutOfQuorum: told to leave")
    assert started == [(1, 1), (1, 2)]
    with pytest.raises(JobStops, match=r"worker rank 0 failed \(exit code 1\): ValueError: boom; the script's own "
                       r"error is not healed .*the job stops"):  # fmt: skip
        quorum.ended(0, 1, "worker rank 0 failed (exit code 1): ValueError: boom")
    assert started == [(1, 1), (1, 2)], "no replacement for a script's own error"
    quorum.ended(0, 0, "")
    assert quorum.ending


def _run(tmp_path: Path, fault: str, steps: int) -> tuple[subprocess.CompletedProcess, Path, Path]:
    return run_heal(tmp_path, "", steps=steps, timeout=150, HEAL_SCRIPT_FAULT=fault)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_worker_whose_script_raises_stops_the_healed_job_naming_its_rank_and_status(tmp_path):
    result, _out, _run_dir = _run(tmp_path, "1:3:raise", steps=30)
    assert result.returncode == 1, result.stderr[-3000:]
    assert ("loom run: worker rank 1 failed (exit code 1): ValueError: the script's own error on rank 1 after "
            "step 3; the script's own error is not healed") in result.stderr, result.stderr[-3000:]  # fmt: skip
    assert "[rank1]: Traceback" in result.stderr  # the worker's own traceback reaches the user, labelled once
    assert "[rank1]: [rank0]:" not in result.stderr, "torch's label of the group of one under heal (issue 37)"
    assert "starting its replacement" not in result.stderr
    assert not list((tmp_path / "run" / "logs").glob("rank1.heal*")), "no replacement was started"
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("loom run: failed after ") and "3 worker(s), 0 heal(s)" in summary, summary


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_worker_told_to_leave_the_quorum_is_replaced_and_the_job_equals_one_process(tmp_path):
    result, out, run_dir = _run(tmp_path, "1:3:leave", steps=8)
    check_healed_job(result, out, run_dir, 8, {1: 1})
    assert (
        "worker rank 1 failed (exit code 75)" in result.stderr and "starting its replacement" in result.stderr
    )
    summary = result.stderr.strip().splitlines()[-1]  # a healed job ends with the summary, naming its heals
    assert summary.startswith("loom run: finished in ") and summary.endswith(
        f"3 worker(s), 1 heal(s), 8 steps; logs and metrics in {run_dir}"
    ), summary


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_replacement_ready_only_after_the_others_finished_is_stopped_and_the_job_succeeds(tmp_path):
    """Rank 1 lost at the last step's commit: the others apply that step and finish; its replacement, made to
    join late, is not needed: the launcher says so and stops it, and the job exits 0 with every step once."""
    result, out, _run = run_heal(tmp_path, "kill@1:10:commit,slow@1:1:join#1", LOOM_FAULTS_SLOW_S="3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("worker rank 1's replacement (generation 1) was still running, outside the job's epoch, when the "
            "others finished: stopped (the job is over)") in result.stderr, result.stderr  # fmt: skip
    found = reports(out)
    for r in (0, 2):
        assert [s[0] for s in found[(r, 0)]["steps"]] == list(range(1, 11)), found[(r, 0)]["steps"]
    assert (1, 1) not in found  # the replacement never trained


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_first_generation_worker_still_running_when_another_finishes_is_awaited_not_dismissed():
    """Review finding A: a script that raises on rank 1 (before any epoch formed) just as rank 0 finishes was
    dismissed as a replacement "not needed" and the job exited 0, its error lost: rank 1 is awaited now, so its
    exit is judged (`HealQuorum.ended`: the job stops naming it)."""
    from loom.launch.heal_nodes import Authority

    authority = Authority([2], HealPolicy(), lambda *args: None, _Store())
    authority.running[0] = None
    authority.quorum.ended(0, 0, "")
    assert authority.quorum.ending and not authority.waiting_only(), "rank 1 (generation 0) is awaited"
    with pytest.raises(
        JobStops, match=r"worker rank 1 failed \(exit code 1\): ValueError: boom; the script's own"
    ):
        authority.quorum.ended(1, 1, "worker rank 1 failed (exit code 1): ValueError: boom")
    # a replacement outside the epoch, still waiting: not needed
    authority.quorum.generation[1] = authority.running[1] = 1
    assert authority.waiting_only()


class _Proc:
    """A worker's process still running when the job ends, whose exit status is ``status`` once killed."""

    def __init__(self, status: int) -> None:
        self.status = status

    def poll(self) -> int | None:
        return None

    def kill(self) -> None:
        pass

    def wait(self) -> int:
        return self.status


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_dismissed_replacement_is_said_stopped_only_if_it_was_still_running(capsys):
    """Review2 finding B: "replacement was not needed" was printed for a replacement that had run and finished (it
    exited 0 as it was dismissed): it is said only of one the kill stopped, with its generation."""
    from types import SimpleNamespace

    from loom.launch.heal_nodes import NodeAgent

    said = "worker rank 1's replacement (generation 1) was still running, outside the job's epoch, when the others"
    for status in (0, -9):
        agent = NodeAgent(
            0, 1, 1, lambda *args: None, lambda r, g, s=status: SimpleNamespace(rank=r, proc=_Proc(s))
        )
        agent._launch(1, 1)  # rank 1's replacement, dismissed
        agent.dismiss()
        err = capsys.readouterr().err
        assert (said in err) if status else ("replacement" not in err), err
