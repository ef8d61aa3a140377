"""The healing benchmark's records, figures, schedule and report (`loom_bench.heal_*`), on hand-made timelines.

No process is started and torchft is not needed: the records are written as the workers would write them, the
kill loop runs against a fake side, and ``os.kill`` is replaced so that nothing is signalled.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom_bench import heal_compare
from loom_bench.heal_compare import KillLoop, RecordTail, parse_arguments, parse_schedule
from loom_bench.heal_records import (
    StepWriter,
    append_kill,
    event_figures,
    healthy_step_time,
    read_records,
    stop_step,
    summarize,
)
from loom_bench.heal_report import render

pytestmark = pytest.mark.unit


def start(replica: int, pid: int, t: float) -> dict:
    return {"kind": "start", "replica": replica, "pid": pid, "t": t}


def step(replica: int, pid: int, t: float, number: int, committed: bool = True, participants: int = 3,
         participating: bool = True) -> dict:  # fmt: skip
    """An attempt that began 0.05 s before it ended."""
    return {"kind": "step", "replica": replica, "pid": pid, "t": t, "t_begin": t - 0.05, "step": number,
            "committed": committed, "participants": participants, "participating": participating}  # fmt: skip


def timeline() -> tuple[list[dict], dict]:
    """3 replicas (pids 100, 101, 102) commit steps 1..10 every 0.1 s; replica 1 is killed at 1.05 s. The
    survivors' attempt at step 11 fails at 1.1 s, they commit it at 1.5 s with 2 participants; replica 1's
    replacement (pid 201) starts at 1.06 s, commits step 13 at 1.7 s without its gradients and step 14 at 1.8 s
    with them. Survivors commit 12 at 1.6 s, then all three 13, 14."""
    records = [start(r, 100 + r, 0.0) for r in range(3)]
    for n in range(1, 11):
        records += [step(r, 100 + r, n * 0.1 + 0.001 * r, n) for r in range(3)]
    kill = {"kind": "kill", "replica": 1, "pid": 101, "step": 10, "t": 1.05, "phase": 0.5}
    records.append(kill)
    records.append(start(1, 201, 1.06))
    records.append({"kind": "ready", "replica": 1, "pid": 201, "t": 1.65})
    for r in (0, 2):
        records += [
            step(r, 100 + r, 1.1, 11, committed=False, participants=2),
            step(r, 100 + r, 1.5 + 0.001 * r, 11, participants=2),
            step(r, 100 + r, 1.6, 12, participants=2),
            step(r, 100 + r, 1.7, 13),
            step(r, 100 + r, 1.8, 14),
        ]
    records += [step(1, 201, 1.7, 13, participating=False), step(1, 201, 1.8, 14)]
    return sorted(records, key=lambda r: r["t"]), kill


def test_figures_of_one_kill() -> None:
    records, kill = timeline()
    step_time = healthy_step_time(records, 3)
    assert step_time == pytest.approx(0.1)
    e = event_figures(records, kill, step_time)
    assert e.survivors_next_commit_s == pytest.approx(1.502 - 1.05)  # the last survivor to commit (replica 2)
    assert e.survivors_resumed_s == e.survivors_next_commit_s  # nothing was in flight past its exchange
    assert e.survivor_steps_not_committed == 1
    assert e.stall_in_steps == pytest.approx((1.502 - 1.05) / 0.1)
    assert e.participants_at_next_commit == 2
    assert e.replacement_pid == 201
    assert e.replacement_first_commit_s == pytest.approx(1.7 - 1.06)
    assert e.replacement_first_commit_steps == 3  # the job had committed 10 when it started; it committed 13
    assert e.replacement_first_contributing_s == pytest.approx(1.8 - 1.06)
    assert e.replacement_first_contributing_steps == 4
    assert e.replacement_ready_s == pytest.approx(1.65 - 1.06)
    assert e.replacement_ready_to_commit_s == pytest.approx(1.8 - 1.65)
    assert e.replacement_ready_to_commit_steps == 2  # 12 committed when it was ready; its first own step: 14


def test_a_step_in_flight_that_commits_after_the_kill_is_not_the_resumption() -> None:
    """torchft commits per replica group: a survivor may commit the step the victim died in (its exchange was
    done), at once; (a*) and (c) then measure from the first step begun after the kill."""
    records, kill = timeline()
    records += [step(r, 100 + r, 1.06, 11, participants=3) for r in (0, 2)]  # began 1.01, before the kill
    for r in records:
        if r["kind"] == "step" and r["pid"] in (100, 102) and r["t"] > 1.07 and r["step"] >= 11:
            r["step"] += 1  # the timeline's later steps shift by the one committed in flight
    e = event_figures(sorted(records, key=lambda r: r["t"]), kill, 0.1)
    assert e.survivors_next_commit_s == pytest.approx(0.01) and e.participants_at_next_commit == 3
    assert e.survivors_resumed_s == pytest.approx(1.502 - 1.05) and e.participants_at_resumed == 2
    assert e.survivor_steps_not_committed == 1


def test_a_replacement_that_never_commits_has_no_figure_and_stays_out_of_the_median() -> None:
    records, kill = timeline()
    records = [r for r in records if r["pid"] != 201 or r["kind"] == "start"]
    e = event_figures(records, kill, 0.1)
    assert e.replacement_pid == 201
    assert e.replacement_first_commit_s is None and e.replacement_first_commit_steps is None
    summary = summarize(records, 3)
    assert summary["medians"]["replacement_first_commit_s"] == {"median": None, "n": 0}
    assert summary["medians"]["survivor_steps_not_committed"] == {"median": 1, "n": 1}


def test_summary_counts_steps_below_full_membership_and_medians_over_kills() -> None:
    records, _ = timeline()
    summary = summarize(records, 3)
    assert summary["steps_committed"] == 14
    assert summary["steps_below_full_membership"] == 2  # steps 11 and 12 with 2 participants
    assert summary["medians"]["survivors_next_commit_s"]["median"] == pytest.approx(0.452)
    assert len(summary["events"]) == 1


def test_writer_lines_read_back_and_a_cut_last_line_is_skipped(tmp_path: Path) -> None:
    writer = StepWriter(tmp_path, replica=2)
    writer.step(1, True, 3)
    writer.step(2, False, 2, participating=False)
    writer.close()
    append_kill(tmp_path, replica=2, pid=writer.pid, step=2, t=1e12)
    (tmp_path / "replica9-pid1.jsonl").write_text(
        '{"kind": "start", "replica": 9, "pid": 1, "t": 0.5}\n{"kind": "st'
    )
    records = read_records(tmp_path)
    kinds = [(r["kind"], r.get("committed")) for r in records if r["pid"] == writer.pid]
    assert kinds == [("start", None), ("step", True), ("step", False), ("kill", None)]
    assert records[0]["pid"] == 1  # t=0.5 sorts first; its cut line is gone


def test_a_malformed_line_inside_a_file_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "replica0-pid5.jsonl").write_text(
        'not json\n{"kind": "start", "replica": 0, "pid": 5, "t": 1}\n'
    )
    with pytest.raises(ValueError, match=r"replica0-pid5.jsonl:1"):
        read_records(tmp_path)


def test_schedule_parsing() -> None:
    assert parse_schedule("1@20, 2@60,0@100") == [(1, 20), (2, 60), (0, 100)]
    for bad in ("1-20", "x@3", "1@20,2@20", "1@30,2@20"):
        with pytest.raises(ValueError, match="--kills"):
            parse_schedule(bad)
    with pytest.raises(SystemExit):
        parse_arguments(["--side", "torchft", "--replicas", "3", "--kills", "3@10"])
    ns = parse_arguments(["--side", "torchft", "--kills", "1@20,2@50"])
    assert ns.steps == 1050 and ns.schedule == [(1, 20), (2, 50)]  # a cap: the harness ends the run


def test_record_tail_returns_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "replica0-pid7.jsonl"
    path.write_text('{"kind": "start", "replica": 0, "pid": 7, "t": 1}\n{"kind": "st')
    tail = RecordTail(tmp_path)
    assert [r["kind"] for r in tail.new_records()] == ["start"]
    with open(path, "a") as out:
        out.write('ep", "replica": 0, "pid": 7, "t": 2, "step": 1, "committed": true, "participants": 3}\n')
    assert [r["kind"] for r in tail.new_records()] == ["step"]
    assert tail.new_records() == []


class FakeSide:
    """Plays a timeline into record files one record per `finished()` call, as if workers were writing."""

    name = "fake"

    def __init__(self, directory: Path, records: list[dict]) -> None:
        self.directory, self.pending, self.replaced = directory, list(records), []

    def start(self) -> None: ...
    def failures(self) -> list[str]:
        return []

    def close(self) -> None: ...
    def describe(self) -> dict[str, object]:
        return {"side": self.name}

    def replace(self, replica: int) -> None:
        self.replaced.append(replica)

    def finished(self) -> bool:
        """Writes the next record; finished once every record was written and read (one more round)."""
        if not self.pending:
            return True
        r = self.pending.pop(0)
        with open(self.directory / f"replica{r['replica']}-pid{r['pid']}.jsonl", "a") as out:
            out.write(json.dumps(r) + "\n")
        return False


def test_kill_loop_kills_the_live_pid_once_due_after_the_last_replacement_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(heal_compare.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(heal_compare.time, "sleep", lambda s: None)
    records = [start(r, 100 + r, 0.0) for r in range(3)]
    records += [step(r, 100 + r, 0.1 + r * 0.001, 1) for r in range(3)]
    records += [step(1, 101, 0.2, 2)]  # the kill at step 2 lands here
    records += [step(1, 101, 0.25, 3), start(1, 201, 0.3)]  # the victim's last line, read after the kill
    records += [step(2, 102, 0.4, 3, participants=2), step(1, 201, 0.5, 3, participants=2)]  # not full yet
    records += [step(1, 201, 0.6, 4), step(2, 102, 0.61, 4)]  # 201 is back: the next kill from step 4 + 1
    records += [step(1, 201, 0.65, 5), step(2, 102, 0.7, 5)]
    records += [start(1, 301, 0.75), step(1, 301, 0.8, 6, participating=False), step(1, 301, 0.9, 7)]
    side = FakeSide(tmp_path, records)
    loop = KillLoop(side, tmp_path, 3, [(1, 2), (1, 3)], phase="0", tail_steps=1)  # type: ignore[arg-type]
    loop.run(deadline_s=30)
    assert [pid for pid, _ in killed] == [
        101,
        201,
    ]  # the second kill: the replacement, at its first full step
    assert side.replaced == [1, 1]
    kills = [r for r in read_records(tmp_path) if r["kind"] == "kill"]
    # not at step 3 (2 present), nor 4 (201 just back): at 201's return + tail_steps
    assert [(k["pid"], k["step"]) for k in kills] == [(101, 2), (201, 5)]
    assert stop_step(tmp_path) == 7 + 1  # the last replacement trained with all present at 7: 1 more step


def test_report_renders_each_side_and_kill() -> None:
    records, _ = timeline()
    summary = summarize(records, 3)
    summary.update(side={"side": "torchft", "heartbeat_timeout_ms": 5000}, wall_s=2.0,
                   load={"before": 1.0, "at_kills": [1.5], "after": 2.0})  # fmt: skip
    text = render({"torchft": summary}, "python -m loom_bench.heal_compare --side torchft",
                  {"hidden": 1024, "batch": 32, "replicas": 3, "kills": "1@10", "steps": 14, "kill_phase": "random",
                   "seed": 0})  # fmt: skip
    assert "| (a) kill -> survivors' next committed step, s | 0.45 (n=1) |" in text
    assert "| 1@10, 0.50 | 0.45 | 2 | 0.45 | 2 | 1 | 4.52 | 0.64 | 3 | 0.74 | 4 |" in text
    assert "1.00; 1.50; 2.00" in text and "heartbeat_timeout_ms=5000" in text
