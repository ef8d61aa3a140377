"""Every strategy runs under loom.fit: resume is bitwise, and model-parallel jobs refuse wrongly sharded data.

Workers: tests/workers/fit_strategies.py (fit with checkpoints, several runs per launch) and
tests/workers/wrong_data.py. The parameter-server strategy has its own tests (tests/test_ps_fit.py): it needs
server processes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_workers

from loom.checkpoint import checkpoint_name

STRATEGIES = ("dp", "pipeline", "tp", "hybrid")


def launch(world_size: int, root: Path, *runs: str) -> dict[str, list[dict]]:
    """Run fit_strategies.py once with ``NAME=DIR:STEPS`` runs (DIR under ``root``); records by run, rank order."""
    args = [f"{run.split('=')[0]}={root / run.split('=')[1]}" for run in runs]
    outputs = run_workers("fit_strategies.py", world_size, *args, timeout=240)
    results: dict[str, list[dict]] = {}
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                results.setdefault(record["run"], []).append(record)
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_strategy_resumed_in_new_processes_equals_a_straight_run_bitwise(tmp_path, world_size):
    # First launch: 20 steps straight, and 10 steps. Second launch, new processes: resume the 10 to 20.
    first = launch(
        world_size, tmp_path, *(f"{s}={s}-{run}" for s in STRATEGIES for run in ("straight:20", "half:10"))
    )
    second = launch(world_size, tmp_path, *(f"{s}={s}-half:20" for s in STRATEGIES))
    reference_loss = first["dp=dp-straight:20"][0]["loss"]
    for strategy in STRATEGIES:
        straight, resumed = (
            first[f"{strategy}={strategy}-straight:20"],
            second[f"{strategy}={strategy}-half:20"],
        )
        assert [r["rank"] for r in resumed] == list(range(world_size))
        assert [(r["steps"], r["resumed_from"]) for r in resumed] == [(20, 10)] * world_size, strategy
        for got, want in zip(resumed, straight, strict=True):
            assert got["state_sha"] == want["state_sha"], f"{strategy}, rank {got['rank']}: not bitwise equal"
            assert got["loss"] == want["loss"], strategy
        # DataParallel equals one process (tests/test_data_parallel.py); the others equal it up to rounding.
        assert abs(straight[0]["loss"] - reference_loss) <= 1e-5, strategy
    assert {r["job"] for s in STRATEGIES[1:] for r in first[f"{s}={s}-straight:20"]} == {"ModelParallelJob"}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_model_parallel_jobs_refuse_data_sharded_over_the_wrong_axis():
    records = [json.loads(line) for out in run_workers("wrong_data.py", 2, timeout=100) for line in out.splitlines()
               if line.startswith("{")]  # fmt: skip
    assert len(records) == 2 * 2 * 2
    for r in records:
        label = f"rank {r['rank']} {r['strategy']} {r['case']}"
        assert r["untouched"], f"{label}: a step was applied"
        if r["case"] == "world_loader":  # refused before any collective, on every rank
            assert "this batch is share" in r["raised"] and "'dp' axis of 1 replica" in r["raised"], label
        else:  # the fingerprints differ across the replica
            assert "the ranks [0, 1] of one model replica" in r["raised"], label
        assert (
            "HINT: shard the data over the job's data axis" in r["raised"] or "job.loader(" in r["raised"]
        ), label


def json_records(stdout: str) -> list[dict]:
    """The JSON lines of raw or ``[rankN]: ``-prefixed output."""
    return [json.loads(line[line.index("{") :]) for line in stdout.splitlines() if "{" in line]


@pytest.mark.system
@pytest.mark.timeout(300)
def test_model_parallel_workers_sigkilled_under_loom_run_restart_and_resume_from_the_last_checkpoint(
    tmp_path,
):
    from test_launcher import run_loom, wait_until_gone

    script = Path(__file__).parent / "workers" / "fit_strategies_elastic.py"
    ckpt = tmp_path / "ckpt"
    args = ["run", "-n", 4, "--max-restarts", 3, "--run-dir", tmp_path / "run", script, ckpt, 12, 8]
    result = run_loom(args, tmp_path, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    assert wait_until_gone(str(script)) == []
    records = json_records(result.stdout)
    # The reference: fresh workers, no failure, resumed from copies of the checkpoints the restarts took (6).
    reference_root = tmp_path / "reference"
    for name in ("pipeline", "tp", "hybrid"):
        shutil.copytree(ckpt / name / checkpoint_name(6), reference_root / name / checkpoint_name(6))
    reference = json_records(
        "".join(run_workers(script.name, 4, str(reference_root), "12", "0", timeout=200))
    )
    for index, name in enumerate(("pipeline", "tp", "hybrid")):
        # Strategy `index` lost a worker on attempt `index`; attempt `index + 1` resumed it from step 6.
        restarted = sorted((r for r in records if r["strategy"] == name and r["attempt"] == index + 1),
                           key=lambda r: r["rank"])  # fmt: skip
        assert [(r["steps"], r["resumed_from"]) for r in restarted] == [(12, 6)] * 4, name
        want = sorted((r for r in reference if r["strategy"] == name), key=lambda r: r["rank"])
        assert [r["state_sha"] for r in restarted] == [r["state_sha"] for r in want], name
