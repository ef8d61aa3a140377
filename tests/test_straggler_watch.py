"""Stragglers for the strategies with no loss all-reduce to carry phase times (`loom.observe.straggler_watch`)."""

import json

import pytest
from conftest import WORKERS, run_workers
from test_launcher import run_loom

from loom.observe.straggler_watch import StragglerWatch
from loom.observe.stragglers import StragglerConfig

FAST, SLOW = [0.001, 0.010, 0.002, 0.001], [0.001, 0.040, 0.002, 0.001]


@pytest.mark.unit
def test_rank_is_judged_against_its_peers_only_and_named_by_its_global_rank():
    # a model-parallel layout: ranks 0 and 2 replicate one stage, 1 and 3 the other (busier by design)
    watch = StragglerWatch(0, 4, [[0, 2], [1, 3], [4]], config=StragglerConfig(window=3))
    rows = {0: [9, *FAST], 2: [9, *SLOW], 1: [9, *SLOW], 3: [9, *SLOW]}
    found = watch.judge(rows)
    assert [(w.rank, w.phase, w.step) for w in found] == [(2, "compute", 9)]
    assert watch.judge(rows) == []  # named once while it stays slow


@pytest.mark.unit
def test_a_rank_without_a_full_window_is_not_judged():
    watch = StragglerWatch(0, 2, [[0, 1]], config=StragglerConfig(window=3))
    assert watch.judge({0: [9, *FAST], 1: None}) == []
    assert watch.judge({0: [9, *FAST]}) == []
    watch.add(*FAST)
    watch.add(*FAST)
    assert watch.summary() is None
    watch.add(*SLOW)
    assert watch.summary() == [3.0, *FAST]  # the median row of the window


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["gossip", "hybrid"])
def test_slowed_rank_is_named_by_a_strategy_without_a_loss_all_reduce(strategy, tmp_path, monkeypatch):
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
