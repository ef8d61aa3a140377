"""ParameterServer under `loom.fit`: exact resume into new workers *and* new servers, a SIGKILLed worker restarted
under ``loom run --max-restarts`` into servers that went on past the checkpoint, and sync equal to one process.

Every job runs through ``loom run -n N --servers 1`` with tests/workers/ps_fit.py (sync, Adam, StepLR, a Dropout
layer seeded per rank), several fit() runs per launch since starting processes is the slow part.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import WORKERS, run_workers
from test_elastic import records
from test_launcher import run_loom, wait_until_gone

pytestmark = pytest.mark.system

SCRIPT = WORKERS / "ps_fit.py"
STEPS = 20


def launch(
    tmp_path: Path, name: str, workers: int, runs: list[dict], *extra, timeout: float = 150
) -> list[dict]:
    """``loom run -n WORKERS --servers 1 [EXTRA] ps_fit.py RUNS`` with a run directory of its own (so its server
    starts empty); returns the JSON records, and the servers' log lines under ``"log"``."""
    args = ["run", "-n", workers, "--servers", 1, *extra, "--run-dir", tmp_path / name, SCRIPT]
    result = run_loom([*args, json.dumps({"runs": runs})], tmp_path, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    assert wait_until_gone(str(SCRIPT)) == []
    log = [line for line in result.stdout.splitlines() if line.startswith("[server")]
    return [dict(r, log=log) for r in records("\n".join(line for line in result.stdout.splitlines()
                                                        if line.startswith("[rank")))]  # fmt: skip


def by_run(found: list[dict], ns: str, attempt: int = 0) -> list[dict]:
    chosen = sorted((r for r in found if r["ns"] == ns and r["attempt"] == attempt), key=lambda r: r["rank"])
    assert chosen, f"no record of run {ns!r} (attempt {attempt})"
    return chosen


def assert_same_run(got: list[dict], want: list[dict], workers: int) -> None:
    """Bitwise: every rank's final parameters and loss, and the servers' whole state (parameters, Adam state,
    hyperparameters, version, every worker's clock) as a digest."""
    assert [r["rank"] for r in got] == list(range(workers))
    for g, w in zip(got, want, strict=True):
        assert g["params"] == w["params"], f"rank {g['rank']}: parameters differ"
        assert g["loss"] == w["loss"] and g["clock"] == w["clock"] == STEPS
    assert got[0]["servers_sha"] == want[0]["servers_sha"], "the servers' state (optimizer included) differs"
    assert got[0]["version"] == [STEPS] and got[0]["clocks"] == [[STEPS] * workers]
    assert all(r["params"] == got[0]["params"] for r in got), "sync workers disagree"


@pytest.fixture(scope="module")
def one_process_reference() -> dict:
    """One process, DataParallel, the same model, optimizer, schedule and global batches (no dropout)."""
    runs = [{"ns": "dp", "dir": None, "steps": STEPS, "strategy": "dp"}]
    (out,) = run_workers("ps_fit.py", 1, json.dumps({"runs": runs}), timeout=120)
    (record,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return record


@pytest.mark.timeout(400)
@pytest.mark.parametrize("workers", [2, 4])
def test_resume_into_new_workers_and_servers_equals_straight(tmp_path, workers, one_process_reference):
    """20 steps straight == 10 steps, then a new `loom run` (new workers, new server) resuming to 20: bitwise.
    The same launches check sync PS under fit against one process (1e-5) and resume an async job's clocks."""
    ckpt = str(tmp_path / "ckpt")
    async_ckpt = str(tmp_path / "async")
    first = launch(tmp_path, "first", workers, [
        {"ns": "plain", "dir": None, "steps": STEPS, "desync": 1},  # sync workers agree after every step
        {"ns": "straight", "dir": None, "steps": STEPS, "dropout": True},
        {"ns": "resumed", "dir": ckpt, "steps": STEPS // 2, "dropout": True},
        {"ns": "async", "dir": async_ckpt, "steps": STEPS // 2, "mode": "async", "desync": 1},
    ])  # fmt: skip
    second = launch(tmp_path, "second", workers, [
        {"ns": "resumed", "dir": ckpt, "steps": STEPS, "dropout": True},
        {"ns": "async", "dir": async_ckpt, "steps": STEPS, "mode": "async", "desync": 1},
    ])  # fmt: skip
    resumed, straight = by_run(second, "resumed"), by_run(first, "straight")
    assert [(r["resumed_from"], r["steps_run"]) for r in resumed] == [(STEPS // 2, STEPS // 2)] * workers
    assert_same_run(resumed, straight, workers)
    assert any(f"model 'resumed': restored at version {STEPS // 2}, clocks {[STEPS // 2] * workers} (was version 0)"
               in line for line in resumed[0]["log"]), resumed[0]["log"]  # fmt: skip
    assert resumed[0]["params"] != by_run(first, "resumed")[0]["params"]  # it did train on

    plain = by_run(first, "plain")
    assert all(r["params"] == plain[0]["params"] for r in plain)
    reference = one_process_reference["params"]
    for name, values in plain[0]["params"].items():
        assert values == pytest.approx(reference[name], abs=1e-5), name
    assert plain[0]["loss"] == pytest.approx(one_process_reference["loss"], abs=1e-5)

    # async (replicas_agree False: fit's desync check skips it) resumes its clocks: each worker's pushes count.
    async_run = by_run(second, "async")
    assert [(r["resumed_from"], r["clock"]) for r in async_run] == [(STEPS // 2, STEPS)] * workers
    assert async_run[0]["version"] == [STEPS * workers] and async_run[0]["clocks"] == [[STEPS] * workers]
    restored = f"model 'async': restored at version {STEPS // 2 * workers}"
    assert any(restored in line for line in async_run[0]["log"]), async_run[0]["log"]


@pytest.mark.timeout(300)
def test_sigkilled_worker_resumes_from_the_fit_checkpoint_into_servers_that_went_on(tmp_path):
    """Rank 1 SIGKILLs itself before step 8 (checkpoints every 3: the last is step 6). The server keeps running
    and holds version 7 when the group restarts, its step 7 taken at 10x the learning rate (so the servers' later
    state is not what the resumed job computes again, and the workers' clocks alone cannot hide it); rank 0's
    restore puts it back to the checkpoint (version 6, both clocks 6), and the job finishes equal, bitwise, to an
    uninterrupted run taken on the restarted attempt."""
    found = launch(tmp_path, "run", 2, [
        {"ns": "killed", "dir": str(tmp_path / "ckpt"), "steps": STEPS, "every": 3, "dropout": True, "kill_at": 8,
         "diverge_at": 7},
        {"ns": "straight", "dir": None, "steps": STEPS, "dropout": True, "attempt": 1},
    ], "--max-restarts", 1, timeout=250)  # fmt: skip
    assert not [r for r in found if r["attempt"] == 0], "the first attempt should not have finished"
    killed = by_run(found, "killed", attempt=1)
    assert [(r["resumed_from"], r["steps_run"]) for r in killed] == [(6, STEPS - 6)] * 2
    assert_same_run(killed, by_run(found, "straight", attempt=1), 2)
    assert any("model 'killed': restored at version 6, clocks [6, 6] (was version 7)" in line
               for line in killed[0]["log"]), killed[0]["log"]  # fmt: skip
