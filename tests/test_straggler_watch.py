"""Stragglers through the watchdog's records (`loom.observe.straggler_watch`): the one mechanism, every strategy."""

import json
from types import SimpleNamespace

import pytest
from conftest import WORKERS, run_workers
from test_launcher import run_loom

from loom.observe.straggler_watch import StragglerWatch
from loom.observe.stragglers import StragglerConfig

FAST, SLOW = [0.001, 0.010, 0.002, 0.001], [0.001, 0.040, 0.002, 0.001]


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_rank_is_judged_against_its_peers_only_and_named_by_its_global_rank():
    # a model-parallel layout: ranks 0 and 2 replicate one stage, 1 and 3 the other (busier by design)
    metrics = SimpleNamespace(slowest=None, path=None)
    watch = StragglerWatch([[0, 2], [1, 3], [4]], config=StragglerConfig(window=3), metrics=metrics)
    job = watch.job
    rows = {0: [job, 9, *FAST], 2: [job, 8, *SLOW], 1: [job, 9, *SLOW], 3: [job, 9, *SLOW]}
    found = watch.judge(rows)
    assert [(w.rank, w.phase, w.step) for w in found] == [(2, "compute", 9)]
    assert watch.judged_steps == 8  # the fewest steps of any row: what was judged for sure
    assert metrics.slowest[:2] == (2, "compute")  # the progress line's, by global rank
    assert watch.judge(rows) == []  # named once while it stays slow


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_rank_without_a_full_window_or_still_on_a_previous_job_is_not_judged(monkeypatch):
    monkeypatch.setenv("LOOM_STRAGGLER_WINDOW", "3")
    watchdog = SimpleNamespace(rank=0, extras={}, poll_hooks={})  # what a watch uses of one
    previous = StragglerWatch.attach(watchdog, [[0, 1]])
    watch = StragglerWatch.attach(watchdog, [[0, 1]])  # a second job on the same rank
    assert watch.job == previous.job + 1 and watchdog.extras["phases"] == watch.summary
    assert watchdog.poll_hooks["stragglers"] == watch.poll
    assert watch.judge({0: [watch.job, 9, *FAST], 1: None}) == []
    assert watch.judge({0: [watch.job, 9, *FAST]}) == []
    assert watch.judge({0: [watch.job, 9, *FAST], 1: [previous.job, 9, *SLOW]}) == []
    assert watch.judged_steps == 0
    assert [w.rank for w in watch.judge({0: [watch.job, 9, *FAST], 1: [watch.job, 9, *SLOW]})] == [1]
    watch.add(*FAST)
    watch.add(*FAST)
    assert watch.summary() is None
    watch.add(*SLOW)
    assert watch.summary() == [watch.job, 3.0, *FAST]  # the median row of the window


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["gossip", "hybrid", "localsgd", "sharded"])
def test_slowed_rank_is_named_in_every_strategy(strategy, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("LOOM_STRAGGLER_WINDOW", "5")
    out = run_workers("straggler_watch_run.py", 2, strategy, "20", timeout=120)
    result = json.loads(out[0].splitlines()[-1])
    named = {(w["rank"], w["phase"]) for w in result["warnings"]}
    assert (1, "compute") in named, result
    assert all(rank == 1 for rank, _ in named), result
    assert '"rank": 1' in (tmp_path / "metrics" / "stragglers.jsonl").read_text()
    phases = result["phases"]
    assert min(phases[k] for k in ("data_s", "compute_s", "comm_s", "optimizer_s")) >= 0


@pytest.mark.system
@pytest.mark.timeout(150)
def test_slowed_asynchronous_parameter_server_worker_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_STRAGGLER_WINDOW", "5")
    args = ["run", "-n", 2, "--servers", 1, "--run-dir", tmp_path / "run", WORKERS / "straggler_watch_run.py"]
    result = run_loom([*args, "ps", "20"], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if '"warnings"' in line)
    found = json.loads(line[line.index("{") :])
    # the slowed rank is named at the phase it is slowed in; on a loaded machine its other phases may be named too
    # (waiting for the server behind the other worker's pushes), never the other rank
    named = {(w["rank"], w["phase"]) for w in found["warnings"]}
    assert (1, "compute") in named and {r for r, _ in named} == {1}, found
    assert "straggler: rank 1" in result.stderr
