"""The pieces of healing LocalSGD and DiLoCo without processes (issue 23): the options a healing round cannot
honour are refused at setup, naming them and the strategies that heal; the engine's per-step vote is the
strategy's to place (`loom.train.engine.Engine._commit`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loom
from loom.parallel._setup import HEALS
from loom.topology import Topology

pytestmark = pytest.mark.unit

ONE = Topology(0, 1, 0, 1, "gloo")
"""A launched job's topology (an explicit ``backend="none"`` one is a plain job under heal: test_heal_reference)."""


@pytest.mark.parametrize(
    "make,named",
    [
        (lambda: loom.LocalSGD(allreduce="shm", topology=ONE), "allreduce"),
        (lambda: loom.DiLoCo(sync_every=4, fragments=2, topology=ONE), "fragments"),
        (lambda: loom.DiLoCo(sync_every=4, overlap_steps=1, topology=ONE), "overlap_steps"),
    ],
)
def test_options_a_healing_round_cannot_honour_are_refused_by_name(make, named, monkeypatch):
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", "heal")
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=rf"--on-worker-failure heal: (LocalSGD|DiLoCo) cannot honour {named}=.* "
                       rf"\(.+\)\. HINT: drop {named}=(, \w+=)* under heal \(the strategies that heal: DataParallel, LocalSGD, "
                       r"DiLoCo\)"):  # fmt: skip
        make().setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)


@pytest.mark.parametrize(
    "make",
    [
        lambda: loom.LocalSGD(liveness_timeout_s=30, topology=ONE),
        lambda: loom.DiLoCo(hang_timeout_s=60, topology=ONE),
        lambda: loom.LocalSGD(allreduce="ring", topology=ONE),  # over each epoch's group, as DataParallel's
        lambda: loom.DiLoCo(allreduce="driver", compression="bf16", topology=ONE),
        lambda: loom.DiLoCo(compression="int8", topology=ONE),
    ],
)
def test_local_sgd_and_diloco_accept_heal_and_need_the_launchers_store(make, monkeypatch):
    # accepted (no refusal): what stops a heal-mode job outside `loom run` is the missing store
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", "heal")
    model = nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match="needs loom.init\\(\\) under loom run"):
        make().setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)
    assert HEALS == "DataParallel, LocalSGD, DiLoCo"


def test_a_job_without_healing_commits_every_step_through_the_engines_hook():
    model = nn.Linear(2, 1)
    job = loom.LocalSGD(sync_every=2, topology=ONE).setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss
    )
    before = [p.detach().clone() for p in model.parameters()]
    job.train_step((torch.ones(4, 2), torch.zeros(4, 1)))
    assert job.step == 1 and any(
        not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )
