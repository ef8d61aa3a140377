"""Non-finite steps are never applied or saved (issue 13, item 3)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from workers.common import make_dataset, make_mlp

import loom
from loom.checkpoint import list_checkpoints
from loom.fault.desync import NonFiniteGuard, NonFiniteStepError, gradients_finite, local_flag
from loom.topology import Topology
from loom.train.fit_checkpoint import NonFiniteStateError, nonfinite_tensors

SINGLE = Topology(0, 1, 0, 1, "none")


def _job(**config):
    model = make_mlp()
    strategy = loom.DataParallel(topology=SINGLE, **config)
    return strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)


def _batch(poison: bool = False):
    x, y = make_dataset()[:8]
    x = x.clone()
    if poison:
        x[0, 0] = float("nan")
    return x, y


# -- the pieces --------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_gradients_finite_sees_nan_and_inf_and_not_large_half_precision_sums():
    assert gradients_finite([torch.ones(3), None])
    assert not gradients_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
    assert not gradients_finite([torch.tensor([float("inf"), -float("inf")])])  # inf - inf: still caught
    assert gradients_finite([torch.full((100,), 60000.0, dtype=torch.float16)])  # sums past fp16's max
    assert not gradients_finite((), flat=torch.tensor([0.0, float("-inf")]))
    assert gradients_finite([])
    assert local_flag(float("nan")) == 1 and local_flag(1.0, [torch.tensor([float("inf")])]) == 2
    assert local_flag(torch.tensor(float("inf")), [torch.tensor([float("nan")])]) == 3


@pytest.mark.unit
def test_guard_skips_counts_stops_and_names_ranks():
    guard = NonFiniteGuard("skip", limit=3, rank=1)
    assert not guard.judge(1, [0, 0], [0, 1])
    assert guard.judge(2, [0, 1], [0, 1]) and guard.skipped == 1
    assert not guard.judge(3, [0, 0], [0, 1]) and guard.in_a_row == 0  # a good step resets the run
    assert guard.judge(4, [0, 0], [0, 1], averaged_gradient_finite=False)
    assert guard.judge(5, [1, 0], [0, 1])
    with pytest.raises(NonFiniteStepError, match=r"3 steps in a row \(steps 4 to 6\).*rank\(s\) \[1\]"):
        guard.judge(6, [0, 1], [0, 1])
    assert guard.history == [2, 4, 5, 6]
    with pytest.raises(NonFiniteStepError, match=r"step 7 is non-finite: non-finite loss on rank\(s\) \[3\]"):
        NonFiniteGuard("stop", rank=0).judge(7, [0, 1], [2, 3])
    with pytest.raises(ValueError, match="nonfinite must be one of 'skip', 'stop', got 'maybe'"):
        NonFiniteGuard("maybe")


@pytest.mark.unit
@pytest.mark.parametrize(
    "config, message",
    [
        ({"nonfinite": "ignore"}, "nonfinite must be one of 'skip', 'stop', got 'ignore'"),
        ({"nonfinite_limit": 0}, "nonfinite_limit"),
    ],
)
def test_data_parallel_refuses_a_bad_policy(config, message):
    with pytest.raises(ValueError, match=message):
        loom.DataParallel(topology=SINGLE, **config)


# -- one process ---------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_nan_step_is_skipped_and_recorded_in_one_process(capsys):
    job = _job()
    job.train_step(_batch())
    before = [p.detach().clone() for p in job.module.parameters()]
    momentum = {k: v["momentum_buffer"].clone() for k, v in enumerate(job.optimizer.state.values())}
    loss = job.train_step(_batch(poison=True))
    assert math.isnan(loss) and job.last_step_skipped and job.skipped_steps == 1 and job.step == 2
    assert all(torch.equal(a, b) for a, b in zip(before, job.module.parameters(), strict=True))
    assert all(
        torch.equal(momentum[k], v["momentum_buffer"]) for k, v in enumerate(job.optimizer.state.values())
    )
    assert all(p.grad is None for p in job.module.parameters())
    assert [r.step for r in job.metrics.records if r.skipped] == [2]
    assert job.metrics.summary()["skipped_steps"] == 1
    assert "step 2 skipped on every rank: non-finite loss on rank(s) [0]" in capsys.readouterr().err
    assert math.isfinite(job.train_step(_batch())) and not job.last_step_skipped


@pytest.mark.unit
def test_policy_stop_raises_naming_rank_and_step():
    job = _job(nonfinite="stop")
    job.train_step(_batch())
    with pytest.raises(NonFiniteStepError, match=r"step 2 is non-finite: non-finite loss on rank\(s\) \[0\]"):
        job.train_step(_batch(poison=True))
    assert all(bool(torch.isfinite(p).all()) for p in job.module.parameters())


@pytest.mark.unit
def test_too_many_nonfinite_steps_in_a_row_stop_the_job():
    job = _job(nonfinite_limit=2)
    job.train_step(_batch(poison=True))
    with pytest.raises(NonFiniteStepError, match=r"2 steps in a row \(steps 1 to 2\)"):
        job.train_step(_batch(poison=True))


@pytest.mark.unit
def test_an_infinite_gradient_with_a_finite_loss_is_skipped():
    job = _job()
    job.module[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    assert math.isfinite(job.train_step(_batch()))
    assert job.last_step_skipped and all(bool(torch.isfinite(p).all()) for p in job.module.parameters())


@pytest.mark.unit
def test_a_batchnorm_share_of_one_sample_is_refused_naming_the_fix():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    job = loom.DataParallel(topology=SINGLE).setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss
    )
    x, y = make_dataset()[:1]
    with pytest.raises(ValueError, match=r"rank 0: 1.*BatchNorm.*drop_last=True.*at least 2 x 1 replicas"):
        job.train_step((x, y))
    job.train_step(make_dataset()[:2])  # two samples: fine


# -- checkpoints -----------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_nonfinite_tensors_names_the_bad_ones():
    state = {"model": {"w": torch.tensor([1.0, float("nan")]), "n": torch.tensor([3])}, "step": 4}
    assert nonfinite_tensors(state) == ["model/w"]
    assert nonfinite_tensors({"a": torch.ones(2)}) == []


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_fit_never_writes_a_nonfinite_checkpoint_and_keeps_the_last_good_one(tmp_path):
    job = _job()
    loader = loom.data.loader(make_dataset(), 6, seed=0, topology=SINGLE)
    train_step = job.train_step

    def diverging_step(batch):  # the weights themselves go bad after step 12 (no non-finite gradient)
        loss = train_step(batch)
        if job.step == 12:
            with torch.no_grad():
                job.module[2].bias[0] = float("inf")
        return loss

    job.train_step = diverging_step
    with pytest.raises(NonFiniteStateError, match=r"step 15 is not written.*step 10, is kept"):
        loom.fit(job, loader, steps=20, checkpoint_dir=tmp_path, checkpoint_every=5, keep=3, progress=False)
    assert sorted(list_checkpoints(tmp_path)) == [5, 10]
    step, state = loom.checkpoint.load_checkpoint(tmp_path)
    assert step == 10 and nonfinite_tensors(state) == []


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_fit_counts_skipped_steps_in_one_process(tmp_path):
    job = _job()
    train_step = job.train_step

    def poisoned(batch):
        if job.step + 1 in (3, 4):
            batch[0][0, 0] = float("nan")
        return train_step(batch)

    job.train_step = poisoned
    loader = loom.data.loader(make_dataset(), 6, seed=0, topology=SINGLE)
    result = loom.fit(job, loader, steps=8, checkpoint_dir=tmp_path, checkpoint_every=2, progress=False)
    assert result.skipped_steps == 2 and result.steps == 8
    assert all(bool(torch.isfinite(p).all()) for p in job.module.parameters())


# -- two processes ---------------------------------------------------------------------------------------------
def _run(workers, tmp_path, strategy: str, policy: str, world_size: int = 2) -> list[dict]:
    outputs = workers("nonfinite_fit.py", world_size, strategy, policy, str(tmp_path / "ckpt"), timeout=100)
    return [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith("{")]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "strategy, world_size",
    [("dp", 2), ("pipeline", 2), ("tp", 2), ("pipeline", 4)],  # pipeline at 4: dp=2 x pp=2
)
def test_a_nan_on_one_rank_is_skipped_everywhere_and_every_kept_checkpoint_is_good(
    workers, tmp_path, strategy, world_size
):
    ranks = _run(workers, tmp_path, strategy, "skip", world_size)
    assert len(ranks) == world_size
    for r in ranks:
        assert r["error"] == "" and r["steps"] == 20
        assert r["params_finite"], r
        assert r["skipped_in_records"] == [10] and r["job_skipped"] == 1 and r["fit_skipped"] == 1
        assert r["checkpoints"] == {"10": True, "15": True, "20": True}  # the newest three, all finite


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy, bad", [("dp", 1), ("pipeline", 1)])
def test_policy_stop_raises_on_every_rank_naming_the_rank_and_step(workers, tmp_path, strategy, bad):
    ranks = _run(workers, tmp_path, strategy, "stop")
    assert len(ranks) == 2
    for r in ranks:
        assert f"step 10 is non-finite: non-finite loss on rank(s) [{bad}]" in r["error"], r
        assert r["steps"] == 9 and r["params_finite"]
        assert r["checkpoints"] == {"5": True}  # the last good checkpoint is kept
