"""A one-process job built inside a healing job (a reference or evaluation model, `topology=` an explicit
``backend="none"`` one) is a plain job: it does not join the healing quorum a second time.

Found on the GPU lane's heal case: the worker script's one-process reference (`loom.DataParallel(topology=one)`)
re-entered its rank's membership, failed the first epoch and left rank 0 behind the job."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loom

pytestmark = pytest.mark.unit
ONE = loom.Topology(0, 1, 0, 1, "none")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [lambda: loom.DataParallel(topology=ONE), lambda: loom.LocalSGD(sync_every=2, topology=ONE)],
                         ids=["DataParallel", "LocalSGD"])  # fmt: skip
def test_an_explicit_one_process_topology_under_heal_is_a_plain_job(monkeypatch, make):
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", "heal")  # as `loom run --on-worker-failure heal` sets it
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    job = make().setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)
    assert job.guard.quorum is None
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    loss = job.train_step(next(iter(job.loader(data, global_batch_size=4))))
    assert loss > 0 and job.step == 1
