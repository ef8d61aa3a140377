"""The step guard holds for every strategy (issue 21, item 2): one place, `loom.train.guard`, reaches them all.

For each strategy: a NaN input on one rank is never applied (synchronous strategies skip the step on every
rank; replicas that judge alone, Gossip and asynchronous parameter servers, skip it on that rank), a rank frozen
with SIGSTOP stops the job with a report naming it, an option the strategy cannot honour is refused, and the
strategy takes its config object as well as keyword arguments.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import WORKERS
from test_ps_launch import session_members

import loom
from loom.parallel.data.data_parallel import ONLY_DATA_PARALLEL
from loom.topology import Topology

SINGLE = Topology(0, 1, 0, 1, "none")
SYNCHRONOUS = ["dp", "pipeline", "tp", "hybrid", "local_sgd", "diloco", "ps"]
ALONE = ["ps_async", "gossip"]
"""Strategies whose replicas judge a non-finite step alone (no collective carries the flags)."""


def _start(tmp_path: Path, strategies: list[str], fault: str) -> subprocess.Popen:
    """`loom run -n 2` the guard job over ``strategies`` (one after the other in the same processes, with a
    parameter server when one of them needs it), started in its own session."""
    out = tmp_path / "out"
    out.mkdir()
    servers = ["--servers", "1"] if any(s.startswith("ps") for s in strategies) else []
    command = [sys.executable, "-m", "loom.cli", "run", "-n", "2", *servers, "--run-dir", str(tmp_path / "run"),
               str(WORKERS / "guard_job.py"), ",".join(strategies), fault, str(out)]  # fmt: skip
    return subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def _finish(proc: subprocess.Popen, what: str, deadline: float) -> tuple[int, str]:
    """Wait for a `_start`ed job until the monotonic ``deadline``; returns (exit status, stderr + stdout).
    Whatever happened, nothing of its session is left behind (a stopped worker included)."""
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"loom run {what} did not end in time") from None
    finally:
        for pid in session_members(proc.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, stderr + stdout


def _run(tmp_path: Path, strategies: list[str], fault: str, timeout: float) -> tuple[int, str]:
    """One guard job, waited for up to ``timeout`` seconds."""
    proc = _start(tmp_path, strategies, fault)
    return _finish(proc, f"{strategies} {fault}", time.monotonic() + timeout)


def _results(tmp_path: Path, strategy: str) -> dict[int, dict]:
    found = (tmp_path / "out").glob(f"result-{strategy}-*.json")
    return {int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text()) for p in found}


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory) -> tuple[Path, int, str]:
    """Every strategy with a NaN input on one rank at step 3, one after the other in one `loom run -n 2`."""
    tmp_path = tmp_path_factory.mktemp("nan")
    status, output = _run(tmp_path, SYNCHRONOUS + ALONE, "nan", timeout=280)
    return tmp_path, status, output


@pytest.mark.system
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", SYNCHRONOUS)
def test_a_nan_on_one_rank_is_skipped_on_every_rank_of_a_synchronous_strategy(nan_run, strategy):
    tmp_path, status, output = nan_run
    assert status == 0, output[-3000:]
    ranks = _results(tmp_path, strategy)
    assert sorted(ranks) == [0, 1], output[-3000:]
    for r in ranks.values():
        assert r["params_finite"], r
        assert r["skipped_steps"] == 1 and r["skipped_in_records"] == [3], r
        assert r["loss_scope"] == "global"


@pytest.mark.system
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ALONE)
def test_a_nan_is_skipped_by_the_replica_that_had_it_when_replicas_judge_alone(nan_run, strategy):
    tmp_path, status, output = nan_run
    assert status == 0, output[-3000:]
    ranks = _results(tmp_path, strategy)
    assert sorted(ranks) == [0, 1], output[-3000:]
    for rank, r in ranks.items():
        assert r["params_finite"], r
        assert r["skipped_steps"] == (1 if rank == 1 else 0) and r["loss_scope"] == "replica", r
        assert r["skipped_in_records"] == ([3] if rank == 1 else []), r


@pytest.fixture(scope="module")
def frozen_runs(tmp_path_factory) -> dict[str, tuple[Path, int, str, float]]:
    """One `loom run -n 2` per synchronous strategy with rank 1 frozen (SIGSTOP) at step 3, all started at once:
    each job spends most of its time waiting out its 5 s hang timeout, so running them side by side costs the
    machine little and the suite about a minute less than one after the other. Each job still has its own
    processes, store and watchdog; the test of each strategy checks its own job."""
    roots = {strategy: tmp_path_factory.mktemp(f"frozen-{strategy}") for strategy in SYNCHRONOUS}
    procs = {strategy: _start(root, [strategy], "freeze") for strategy, root in roots.items()}
    deadline = time.monotonic() + 240
    finished: dict[str, tuple[Path, int, str, float]] = {}
    errors: list[BaseException] = []

    def wait(strategy: str) -> None:  # a thread each: every job's output is read as it comes (no full pipe)
        try:
            status, output = _finish(procs[strategy], f"[{strategy}] freeze", deadline)
            finished[strategy] = (roots[strategy], status, output, time.time())
        except BaseException as error:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=wait, args=(strategy,)) for strategy in procs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return finished


@pytest.mark.system
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", SYNCHRONOUS)
def test_a_frozen_rank_stops_the_job_naming_it(frozen_runs, strategy):
    tmp_path, status, output, ended = frozen_runs[strategy]
    frozen = tmp_path / "out" / "frozen-at"
    assert frozen.exists(), output[-3000:]
    bad = 0 if strategy == "pipeline" else 1
    assert status != 0, output[-3000:]
    assert f"ranks [{bad}] did not arrive" in output, output[-3000:]
    print(f"{strategy}: the job ended {ended - float(frozen.read_text()):.1f} s after rank {bad} froze")


# -- options: refused by name, or taken as a config object --------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("strategy", ["Pipeline", "TensorParallel", "Hybrid", "Gossip", "ParameterServer"])
def test_strategies_without_a_step_observer_refuse_observe_naming_the_fix(strategy):
    sizes = {"Pipeline": {"stages": 1}, "TensorParallel": {"size": 1}}.get(strategy, {})
    with pytest.raises(
        ValueError, match=rf"{strategy} does not take observe \(.*no step observer.*drop observe="
    ):
        getattr(loom, strategy)(**sizes, observe=False)


@pytest.mark.unit
@pytest.mark.parametrize("option", sorted(ONLY_DATA_PARALLEL))
@pytest.mark.parametrize("strategy", ["Pipeline", "TensorParallel", "Hybrid"])
def test_model_parallel_strategies_refuse_the_options_only_data_parallel_honours(strategy, option):
    sizes = {"Pipeline": {"stages": 1}, "TensorParallel": {"size": 1}, "Hybrid": {}}[strategy]
    value = {"accumulate": 4, "bucket_cap_mb": 5.0, "overlap": True}.get(option, True)
    with pytest.raises(ValueError, match=rf"{strategy} does not take {option} \(.*DataParallel only"):
        getattr(loom, strategy)(**sizes, **{option: value})


@pytest.mark.unit
def test_the_data_axis_options_a_model_parallel_job_honours_are_accepted():
    strategy = loom.Pipeline(
        stages=1, hang_timeout_s=5, work_timeout_s=60, nonfinite="stop", allreduce="ring"
    )
    assert strategy.data.hang_timeout_s == 5 and strategy.data.nonfinite == "stop"


@pytest.mark.unit
@pytest.mark.parametrize(
    "strategy, config",
    [
        (loom.DataParallel, loom.DataParallelConfig(accumulate=2, hang_timeout_s=7)),
        (loom.LocalSGD, loom.LocalSGDConfig(sync_every=3, hang_timeout_s=7)),
        (loom.DiLoCo, loom.DiLoCoConfig(sync_every=4, hang_timeout_s=7)),
        (loom.Gossip, loom.GossipConfig(every=2, hang_timeout_s=7)),
        (loom.ParameterServer, loom.ParameterServerConfig(mode="async", hang_timeout_s=7)),
    ],
)
def test_every_strategy_takes_its_config_object(strategy, config):
    assert strategy(config).config == config
    with pytest.raises(ValueError, match="and the options"):
        strategy(config, hang_timeout_s=3)
    with pytest.raises(TypeError, match=f"takes a {type(config).__name__}"):
        strategy(object())


@pytest.mark.unit
@pytest.mark.parametrize(
    "make",
    [
        lambda **o: loom.DataParallel(**o),
        lambda **o: loom.LocalSGD(**o),
        lambda **o: loom.DiLoCo(**o),
        lambda **o: loom.Gossip(**o),
        lambda **o: loom.ParameterServer(**o),
        lambda **o: loom.Pipeline(stages=1, **o),
        lambda **o: loom.TensorParallel(size=1, **o),
        lambda **o: loom.Hybrid(**o),
    ],
)
def test_every_strategy_validates_the_guard_options_alike(make):
    with pytest.raises(ValueError, match="nonfinite must be one of 'skip', 'stop', got 'maybe'"):
        make(nonfinite="maybe")
    with pytest.raises(ValueError, match="nonfinite_limit"):
        make(nonfinite_limit=0)
    with pytest.raises(ValueError, match="LOOM_HANG_TIMEOUT_S|hang"):
        make(hang_timeout_s=-1)
