"""Step records, straggler warnings and traces: logic on synthetic tables, then one real 2-process run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_workers

from loom.observe.report import load_records
from loom.observe.stragglers import StragglerConfig, StragglerDetector
from loom.observe.trace import merge_traces, merge_traces_and_say, parse_steps

STEPS = 16
TRACE = (5, 8)


def _feed(detector: StragglerDetector, rows, judgements: int = 3):
    """Judge ``rows`` (every rank's median phase times over its window) as often as the straggler watch would
    in a few of its periods; the new warnings of all of them."""
    found = []
    for step in range(1, judgements + 1):
        found += detector.judge(10 * step, rows)
    return found


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_detector_names_the_slow_rank_and_phase_not_the_waiting_one():
    fast, waiting = (0.001, 0.010, 0.001, 0.001), (0.001, 0.010, 0.031, 0.001)
    slow_data = (0.031, 0.010, 0.001, 0.001)
    found = _feed(StragglerDetector(StragglerConfig(window=5)), [waiting, slow_data, waiting])
    assert [(w.rank, w.phase) for w in found] == [(1, "data")]  # once per episode, not every judgement
    slow_compute = (0.001, 0.040, 0.001, 0.001)
    found = _feed(StragglerDetector(StragglerConfig(window=5)), [waiting, slow_compute])
    assert [(w.rank, w.phase) for w in found] == [(1, "compute")]
    assert _feed(StragglerDetector(StragglerConfig(window=5)), [fast, fast]) == []


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_detector_rearms_after_recovery_and_names_slow_communication():
    detector = StragglerDetector(StragglerConfig(window=2))
    normal, slow = (0.001, 0.010, 0.001, 0.001), (0.001, 0.010, 0.001, 0.001)
    # rank 2's own push/pull is slow, and its busy time is not below the median
    slow_link = (0.001, 0.010, 0.020, 0.001)
    assert [(w.rank, w.phase) for w in _feed(detector, [normal, slow, slow_link], 3)] == [(2, "comm")]
    assert _feed(detector, [normal, normal, normal], 3) == []
    assert [w.rank for w in _feed(detector, [normal, slow, slow_link], 3)] == [2]


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_configuration_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="window"):
        StragglerConfig(window=0)
    monkeypatch.setenv("LOOM_STRAGGLER_MARGIN", "0.5")
    monkeypatch.setenv("LOOM_STRAGGLER_WINDOW", "7")
    assert StragglerConfig.from_env() == StragglerConfig(margin=0.5, window=7)
    assert parse_steps("10:20") == (10, 20)
    assert parse_steps("7:7") == (7, 7)  # one step: the launcher's rule (loom.settings) is the workers' rule
    for bad in ("ten", "0:3", "5:2", "4"):
        with pytest.raises(ValueError, match=f"FIRST:LAST.*got '{bad}'"):
            parse_steps(bad)


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """One 2-process job: a plain traced run, then rank 1 slowed in data, then in compute."""
    out = tmp_path_factory.mktemp("observe")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_RUN_DIR", str(out / "run"))
        mp.setenv("LOOM_TRACE_STEPS", f"{TRACE[0]}:{TRACE[1]}")
        mp.setenv("LOOM_STRAGGLER_WINDOW", "5")
        outs = run_workers("observe_run.py", 2, str(out), str(STEPS), "plain", "data", "compute", timeout=100)
    results = {r["mode"]: r for r in map(json.loads, outs[0].splitlines())}
    return out, results


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["data", "compute"])
def test_warning_names_the_slowed_rank_and_phase(observed_run, phase):
    out, results = observed_run
    named = {(w["rank"], w["phase"]) for w in results[phase]["warnings"]}
    assert (1, phase) in named, results[phase]
    assert all(rank == 1 for rank, _ in named), results[phase]
    assert f"slowest rank 1 ({phase}" in results[phase]["status"]
    written = (out / phase / "metrics" / "stragglers.jsonl").read_text()
    assert f'"phase": "{phase}"' in written


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_every_step_of_every_rank_is_recorded_with_phases_summing_to_the_step(observed_run):
    out, _ = observed_run
    # "run" is traced (DDP runs a timed Python hook), "data" and "compute" are not (DDP's built-in all-reduce)
    for run, rank in [(run, rank) for run in ("run", "data", "compute") for rank in (0, 1)]:
        lines = (out / run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        # every record is written as its step ends; a memory-sampled step's (1 and 2) again with its memory
        assert [json.loads(line)["step"] for line in lines] == [1, 1, 2, 2, *range(3, STEPS + 1)]
        records = load_records(out / run)[rank]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert all("memory" in r for r in records[:2])
        for r in records:
            phases = r["data_s"] + r["compute_s"] + r["comm_s"] + r["optimizer_s"]
            assert phases == pytest.approx(r["time_s"], rel=0.05), r
            assert min(r["data_s"], r["compute_s"], r["comm_s"], r["optimizer_s"]) >= 0
            assert r["bytes_sent"] > 0 and r["bytes_received"] > 0
            assert r["samples"] > 0 and r["global_samples"] in (8, 37 % 8)  # 37 samples: a short last batch


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_trace_is_chrome_json_with_every_rank_and_collective_in_the_window(observed_run):
    out, _ = observed_run
    events = json.loads(merge_traces(out / "run").read_text())["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid"} <= e.keys()
        if e["ph"] == "X":
            assert isinstance(e["ts"], float | int) and e["dur"] >= 0 and "tid" in e
    seqs = {}
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert {e["args"]["step"] for e in mine} == set(range(TRACE[0], TRACE[1] + 1))
        assert {"data", "compute", "comm", "optimizer"} <= {e["name"] for e in mine if e["cat"] == "phase"}
        collectives = [e for e in mine if e["cat"] == "collective"]
        seqs[rank] = sorted(e["args"]["seq"] for e in collectives)
        # per step: one gradient bucket (a small model) and the loss all-reduce, or, with shared-memory
        # gradients (one host, no spare core), one collective that carries both
        together = any(e["name"].startswith("all_reduce gradients and loss #") for e in collectives)
        assert len(collectives) == (1 if together else 2) * (TRACE[1] - TRACE[0] + 1)
    assert seqs[0] == seqs[1]  # the same collectives, numbered alike on both ranks


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_launchers_say_where_the_merged_timeline_is_or_why_not(tmp_path, capsys):
    merge_traces_and_say(tmp_path, "loom run")  # no traces: nothing to say
    assert capsys.readouterr().err == ""
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "rank0.json").write_text(
        json.dumps({"traceEvents": [{"name": "a", "ph": "i", "pid": 0}]})
    )
    merge_traces_and_say(tmp_path, "loom run")
    assert capsys.readouterr().err == f"loom run: timeline written to {tmp_path / 'trace.json'}\n"
    (tmp_path / "trace" / "rank1.json").write_text("{not json")
    merge_traces_and_say(tmp_path, "loom")
    assert capsys.readouterr().err.startswith("loom: could not merge the trace files: ")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_healed_ranks_replacements_continue_its_series_and_stray_files_are_ignored(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()

    def write(name: str, steps: list[int], who: str) -> None:
        (metrics / name).write_text("".join(json.dumps({"step": s, "who": who}) + "\n" for s in steps))

    write("rank0.jsonl", [1, 2, 3], "first")  # killed during step 3: its replacement re-runs it
    write("rank0.heal2.jsonl", [5, 6], "second")
    write("rank0.heal1.jsonl", [3, 4, 5], "first replacement")
    write("rank1.jsonl", [1, 2, 3, 4, 5, 6], "r1")
    write("rank1.bak.jsonl", [7], "stray")
    records = load_records(tmp_path)
    assert sorted(records) == [0, 1]
    assert [(r["step"], r["who"]) for r in records[0]] == [
        (1, "first"),
        (2, "first"),
        (3, "first replacement"),
        (4, "first replacement"),
        (5, "second"),
        (6, "second"),
    ]
    assert [r["step"] for r in records[1]] == [1, 2, 3, 4, 5, 6]
