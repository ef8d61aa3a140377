"""Uneven work between collectives (issue 16): rank-0-only work is not a hang nor a straggler; a true hang is."""

from __future__ import annotations

import time

import pytest

from loom.fault.hang_report import all_inside_s
from loom.fault.watchdog import Watchdog

TIMEOUT_S, SLEEP_S = 3.0, 8.0


def _stages(path) -> dict[str, float]:
    lines = [line.rsplit(" ", 1) for line in path.read_text().splitlines()]
    return {text: float(at) for text, at in lines}


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_rank0_alone_past_the_timeout_is_ordinary_and_a_true_hang_still_stops(workers, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_STRAGGLER_WINDOW", "4")  # the sleep's step is in 4 windows, never their median
    monkeypatch.setenv("LOOM_STRAGGLER_MARGIN", "1.0")  # and only a rank twice as slow as the median,
    monkeypatch.setenv("LOOM_STRAGGLER_MIN_MS", "50")  # by 50 ms, counts: no flakes from a busy machine
    progress = tmp_path / "progress"
    with pytest.raises(AssertionError) as stopped:
        workers("uneven_work.py", 2, str(TIMEOUT_S), str(SLEEP_S), str(progress), timeout=50)
    stages = _stages(progress)
    report = str(stopped.value)
    print(report)
    assert stages["evaluated"] - stages["evaluating"] >= SLEEP_S  # rank 1 waited 8 s in a collective: no stop
    assert "straggler warnings 0 judged through 17" in stages  # judged: every rank's window to the last step
    assert "the hang went unnoticed" not in stages
    assert "loom watchdog: rank" in report and "exited 1" in report
    assert "did not arrive" in report or "another rank reported" in report
    # The watchdog's report, not the harness's 50 s limit, ended it (asserted above); the delay is printed in the
    # report. A bound as generous as the limit: under load the stop may take longer than the timeout + 15 s.
    assert time.time() - stages["entering the metric all-reduce"] < 50


class _Store:
    def __init__(self, records: dict[int, str]) -> None:
        self.records = records
        self.asked: list[str] = []
        self.counts: dict[str, int] = {}

    def check(self, keys):
        return all(
            k.rsplit("rank", 1)[1].isdigit() and int(k.rsplit("rank", 1)[1]) in self.records for k in keys
        )

    def get(self, key):
        return self.records[int(key.rsplit("rank", 1)[1])].encode()

    def set(self, key, value):
        self.asked.append(key.rsplit("/", 1)[1])

    def add(self, key, amount):
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_hang_is_judged_on_the_time_every_rank_spent_inside_collectives():
    now = time.time()
    inside = {"current": ["loss all-reduce", 8], "waiting_s": 5.0, "done": ["x", 7], "time": now - 1}
    working = {"current": None, "done": ["x", 7], "time": now - 0.2}  # alive: published 0.2 s ago
    silent = {"current": None, "done": ["x", 7], "time": now - 100}  # dead or frozen for 100 s
    assert all_inside_s({0: None, 1: inside}, 0, 9.0) == pytest.approx(6.0, abs=0.1)
    assert all_inside_s({0: None, 1: inside, 2: working}, 0, 9.0) < 0.5
    assert all_inside_s({0: None, 1: silent}, 0, 9.0) == pytest.approx(9.0)
    assert all_inside_s({0: None, 1: None}, 0, 9.0) == 9.0  # unreadable: cannot be shown to be working


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_work_timeout_stops_a_wait_for_a_rank_that_never_comes_back(monkeypatch):
    import json

    wd = Watchdog(0, 2, timeout_s=1.0, work_timeout=2.0)
    wd.store = _Store({1: json.dumps({"current": None, "done": ["x", 1], "time": time.time()})})
    stops: list[str | None] = []
    monkeypatch.setattr(wd, "_report_and_exit", lambda current, why=None, records=None: stops.append(why))
    start = time.monotonic()
    wd.current = ("metric all-reduce", 2, start - 1.5)  # waited 1.5 s: past the timeout, rank 1 is working
    wd._judge(wd.current)
    assert stops == []
    assert wd.store.asked == ["stack1"]  # rank 1, working past the hang timeout, is asked for its stack, once
    wd.current = ("metric all-reduce", 2, start - 2.5)  # past the work timeout
    wd._judge(wd.current)
    assert stops and "ranks [1] were outside collectives longer than the work timeout (2 s" in stops[0]
    monkeypatch.delenv("LOOM_WORK_TIMEOUT_S", raising=False)
    assert Watchdog(0, 2, timeout_s=1.0).work_timeout_s == 1800.0  # PyTorch's gloo default
