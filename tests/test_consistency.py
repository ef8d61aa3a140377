"""Replicas that differ are refused at setup, and fit checks replicas by default (issue 13, item 7)."""

from __future__ import annotations

import inspect
import json
import sys

import pytest
import torch
from torch import nn

import loom
from loom.parallel.consistency import model_signature, optimizer_signature
from loom.train.fit import DESYNC_EVERY


def _mlp(activation=nn.Tanh) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), activation(), nn.Dropout(0.1), nn.Linear(16, 4))


@pytest.mark.unit
def test_signatures_see_types_and_hyperparameters_not_only_shapes():
    tanh, relu = model_signature(_mlp()), model_signature(_mlp(nn.ReLU))
    assert [e for e in tanh if e[0] != "module"] == [e for e in relu if e[0] != "module"]  # same shapes
    assert ["module", "1", "Tanh()"] in tanh and ["module", "1", "ReLU()"] in relu
    assert ["module", "0", "Linear(in_features=8, out_features=16, bias=True)"] in tanh
    assert ["module", "2", "Dropout(p=0.1, inplace=False)"] in tanh
    model = _mlp()
    sgd = optimizer_signature(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    adam = optimizer_signature(torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.99)))
    assert ["optimizer", "type", "SGD"] in sgd and ["optimizer", "param_groups[0].momentum", "0.9"] in sgd
    assert ["optimizer", "param_groups[0].betas", "[0.8, 0.99]"] in adam


_CASES: dict[tuple[str, int], dict] = {}


@pytest.fixture
def setup_cases(workers):
    """Every setup case in one launch of 2 processes (cached: the cases are independent of each other)."""
    if not _CASES:
        cases = ("tanh_relu", "lr", "sgd_adam", "dropout", "same", "batchnorm")
        outputs = workers("consistency_setup.py", 2, *cases, timeout=100)
        rows = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith("{")]
        _CASES.update({(r["case"], r["rank"]): r for r in rows})
    return _CASES


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case, difference",
    [
        ("tanh_relu", "module '1': Tanh() on rank 0 vs ReLU() on rank 1"),
        ("lr", "optimizer 'param_groups[0].lr': 0.1 on rank 0 vs 0.01 on rank 1"),
        ("sgd_adam", "optimizer 'type': SGD on rank 0 vs Adam on rank 1"),
        ("dropout", "Dropout(p=0.1, inplace=False) on rank 0 vs Dropout(p=0.2, inplace=False) on rank 1"),
    ],
)
def test_replicas_that_differ_are_refused_on_every_rank_naming_the_difference(setup_cases, case, difference):
    for rank in (0, 1):
        row = setup_cases[(case, rank)]
        assert row["refused"], row
        assert difference in row["message"], row["message"]
        assert "ranks that differ from rank 0: [1]" in row["message"]
        assert f"seen on rank {rank}" in row["message"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_equal_replicas_are_accepted(setup_cases):
    assert not setup_cases[("same", 0)]["refused"] and not setup_cases[("same", 1)]["refused"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_one_sample_batchnorm_share_is_refused_on_every_rank_naming_the_fix(setup_cases):
    for rank in (0, 1):
        message = setup_cases[("batchnorm", rank)]["message"]
        assert setup_cases[("batchnorm", rank)]["refused"]
        assert "at step 2 the global batch of 3 sample(s)" in message and "(rank 1: 1)" in message
        assert "drop_last=True" in message and "at least 2 x 2 replicas = 4 samples" in message


@pytest.mark.unit
def test_fit_checks_replicas_by_default(tmp_path, monkeypatch):
    """With fit's defaults the replicas are compared every `DESYNC_EVERY` steps and before every checkpoint
    (one process has no data group, so the job is given one to compare over and the check is recorded)."""
    assert inspect.signature(loom.fit).parameters["desync_every"].default == DESYNC_EVERY > 0
    fit_module = sys.modules["loom.train.fit"]  # `loom.fit` the attribute is the function
    checked: list[int] = []
    monkeypatch.setattr(fit_module, "check_replicas_agree", lambda module, group, step: checked.append(step))
    loom.init()
    model = nn.Linear(4, 2)
    job = loom.DataParallel().setup(
        model, torch.optim.SGD(model.parameters(), lr=0.01), nn.functional.mse_loss
    )
    monkeypatch.setattr(job.mesh, "group", lambda axis: object() if axis == "dp" else None)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    steps, every = 2 * DESYNC_EVERY + 1, DESYNC_EVERY + DESYNC_EVERY // 2
    loom.fit(
        job, job.loader(data, 4), steps=steps, checkpoint_dir=tmp_path, checkpoint_every=every, progress=False
    )
    assert checked == sorted({DESYNC_EVERY, 2 * DESYNC_EVERY, every, steps})  # the last one: the final save


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_default_desync_check_stops_a_drifting_replica_before_a_checkpoint(workers, tmp_path):
    outputs = workers("consistency_desync_default.py", 2, str(tmp_path / "ckpt"), timeout=100)
    rows = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for row in rows:
        assert row["raised_at"] == 6, row  # the first checkpoint: its check runs before the write
        assert "ranks [1] hold parameters different from ranks [0]" in row["message"]
        assert row["written"] == []  # the desynchronized state was never saved
