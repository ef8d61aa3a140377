"""LocalSGD: ``sync_every=1`` with plain SGD equals DataParallel and one process, uneven and empty shares included;
resumed in new processes mid-interval it equals a straight run bitwise; bad options are named.

Workers: tests/workers/local_sgd_exact.py (LocalSGD, DiLoCo, DataParallel and a one-process reference on the same
global batches) and tests/workers/local_sgd_fit.py (loom.fit with checkpoints). Both launches are shared with
tests/test_diloco.py through `exact_runs` and `fit_runs` (starting processes is the slow part).
"""

from __future__ import annotations

import functools
import json
import tempfile

import pytest
import torch
from conftest import run_workers
from torch import nn
from workers.common import make_dataset, make_mlp

import loom
from loom.topology import Topology

SINGLE = Topology(0, 1, 0, 1, "none")
N_SAMPLES, GLOBAL_BATCH, STEPS = 10, 3, 8
"""10 samples in global batches of 3: shares 2/1 (2 ranks) or 1/1/1/0 (4 ranks), and a last batch of 1 sample
(an empty share on every rank but one), twice over (8 steps: two epochs)."""
STRATEGIES = ("local", "diloco", "streaming")
_KEEP: list[tempfile.TemporaryDirectory] = []


@functools.cache
def exact_runs(world_size: int) -> dict[str, list[dict]]:
    """``{case: [record of rank 0, rank 1, ...]}`` of one launch of local_sgd_exact.py (``reference``: rank 0)."""
    outputs = run_workers(
        "local_sgd_exact.py", world_size, str(N_SAMPLES), str(GLOBAL_BATCH), str(STEPS), timeout=100
    )
    runs: dict[str, list[dict]] = {}
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                runs.setdefault(record["case"], []).append(record)
    return runs


@functools.cache
def fit_runs(world_size: int) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """Two launches of local_sgd_fit.py for every strategy: 20 steps straight and 10; then, in new processes,
    the 10 resumed to 20. Returns (first launch, second launch), ``{NAME=DIR:STEPS: [records by rank]}``."""
    root = tempfile.TemporaryDirectory(prefix="loom-local-sgd-")
    _KEEP.append(root)

    def launch(*runs: str) -> dict[str, list[dict]]:
        args = [f"{run.split('=')[0]}={root.name}/{run.split('=')[1]}" for run in runs]
        results: dict[str, list[dict]] = {}
        for out in run_workers("local_sgd_fit.py", world_size, *args, timeout=100):
            for line in out.splitlines():
                if line.startswith("{"):
                    record = json.loads(line)
                    results.setdefault(record["run"], []).append(record)
        return results

    first = launch(*(f"{s}={s}-{run}" for s in STRATEGIES for run in ("straight:20", "half:10")))
    second = launch(*(f"{s}={s}-half:20" for s in STRATEGIES))
    return first, second


def assert_resumed_bitwise(name: str, world_size: int) -> None:
    first, second = fit_runs(world_size)
    straight, half, resumed = (first[f"{name}={name}-straight:20"], first[f"{name}={name}-half:10"],
                               second[f"{name}={name}-half:20"])  # fmt: skip
    assert [(r["steps"], r["resumed_from"]) for r in half] == [(10, None)] * world_size
    assert [(r["steps"], r["resumed_from"]) for r in resumed] == [(20, 10)] * world_size
    for got, want in zip(resumed, straight, strict=True):
        assert got["rank"] == want["rank"]
        assert got["state_sha"] == want["state_sha"], f"{name}, rank {got['rank']}: not bitwise equal"
        assert got["loss"] == want["loss"], name
    # the replicas drift between synchronizations: their states differ (per-rank checkpoints are needed)
    assert len({r["state_sha"] for r in straight}) == world_size, name


def assert_close(got: dict, want: dict, tol: float, label: str) -> None:
    for (name, a), b in zip(got["params"].items(), want["params"].values(), strict=True):
        diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item()
        assert diff <= tol, f"{label}: parameter {name} differs by {diff}"
    loss_diff = max(abs(x - y) for x, y in zip(got["losses"], want["losses"], strict=True))
    assert loss_diff <= tol, f"{label}: losses differ by {loss_diff}"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_sync_every_step_equals_data_parallel_and_one_process(world_size):
    runs = exact_runs(world_size)
    reference = runs["reference"][0]
    for case in ("local_sgd", "local_sgd_ring", "dp"):
        assert [r["rank"] for r in runs[case]] == list(range(world_size)), case
        for record in runs[case]:
            assert_close(record, reference, 1e-5, f"{case} rank {record['rank']} vs one process")
    for record, dp in zip(runs["local_sgd"], runs["dp"], strict=True):
        assert_close(record, dp, 1e-5, f"LocalSGD rank {record['rank']} vs DataParallel")
    # every rank returned the global-batch loss, the same on each
    assert len({json.dumps(r["losses"]) for r in runs["local_sgd"]}) == 1


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_resumed_mid_interval_in_new_processes_equals_a_straight_run_bitwise():
    assert_resumed_bitwise("local", 2)  # sync_every=4, checkpoint at step 10


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_one_process_with_averaging_every_few_steps_is_plain_training():
    """With one replica the average is the replica itself: any sync_every equals a plain loop."""
    data = make_dataset()
    model, plain = make_mlp(), make_mlp()
    job = loom.LocalSGD(sync_every=3, topology=SINGLE, observe=False).setup(
        model, torch.optim.Adam(model.parameters(), lr=0.01), nn.functional.mse_loss
    )
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    for batch in job.loader(data, 8, seed=2):
        loss = job.train_step(batch)
        optimizer.zero_grad()
        want = nn.functional.mse_loss(plain(batch[0]), batch[1])
        want.backward()
        optimizer.step()
        assert abs(loss - want.item()) <= 1e-6
    assert job.averages == len(job.loader(data, 8)) // 3 and job.averages > 0
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sync_every": 0}, "sync_every must be an int >= 1, got 0"),
        ({"sync_every": 2.5}, "sync_every must be an int >= 1, got 2.5"),
        (
            {"allreduce": "carrier-pigeon"},
            "allreduce must be one of 'native', 'ring', 'driver', 'shm', 'hierarchical', 'auto', got 'carrier-pigeon'",
        ),
        ({"nonfinite": "ignore"}, "nonfinite must be one of 'skip', 'stop', got 'ignore'"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        loom.LocalSGD(**options)
