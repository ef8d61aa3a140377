"""A sharded data axis (``zero=1``, `loom.parallel.data.sharded_axis`) on model-parallel jobs: Hybrid(dp=2, tp=2)
and Pipeline(stages=2) with dp=2 on 4 processes equal one process (Adam, SGD with momentum, uneven shares); this
rank's optimizer state is half the unsharded job's; a loom.fit checkpoint resumes bitwise; what is not supported
is refused by name."""

import copy
import json

import pytest
import torch
from torch import nn

import loom
from loom.parallel.data.data_parallel_config import DataAxisConfig


def _records(outputs):
    return [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outputs]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_sharded_data_axis_equals_one_process_with_half_the_optimizer_state(workers):
    per_rank = _records(workers("hybrid_sharded.py", 4, "exact", timeout=230))
    for rank, records in enumerate(per_rank):
        cases, (memory,) = records[:-1], records[-1:]
        assert [c["case"] for c in cases] == [
            "gpt adam Hybrid", "gpt sgd Hybrid", "mlp adam Pipeline", "mlp sgd Pipeline",
        ], rank  # fmt: skip
        for c in cases:
            assert c["dp"] == 2, c
            assert c["loss"] <= 1e-5, f"rank {rank}: {c}"
            if rank == 0:
                assert c["params"] <= 1e-5, c
            else:
                assert "params" not in c, c  # full_state_dict is for rank 0 only
        whole, sliced = memory["memory"]["0"], memory["memory"]["1"]
        # The live-tensor walk and the optimizer's own state tensors agree on the optimizer's bytes.
        assert whole["optimizer"] == whole["summed"] and sliced["optimizer"] == sliced["summed"], memory
        # 1/dp of the unsharded job's Adam moments (plus Adam's per-tensor step counters, a few bytes).
        ratio = sliced["optimizer"] / whole["optimizer"]
        assert 0.45 <= ratio <= 0.5 * 1.10, f"rank {rank}: optimizer state {ratio:.3f} of the unsharded job's"
        # Between steps only this replica's slice of the averaged gradient is kept.
        assert sliced["gradients"] <= 0.55 * sliced["parameters"], memory
        assert sliced["parameters"] == whole["parameters"], memory  # ZeRO-1: whole parameters everywhere


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_fit_checkpoint_of_a_sharded_data_axis_resumes_exactly(workers, tmp_path):
    straight, part = tmp_path / "straight", tmp_path / "part"
    runs = [f"straight={straight}:8", f"part={part}:4", f"part={part}:8", f"zero0={part}:10"]
    per_rank = _records(workers("hybrid_sharded.py", 4, "fit", *runs, timeout=230))
    shas = set()
    for rank, (whole, first, resumed, refused) in enumerate(per_rank):
        assert whole["steps"] == 8 and whole["resumed_from"] is None, whole
        assert first["steps"] == 4 and resumed["resumed_from"] == 4 and resumed["steps"] == 8, resumed
        assert resumed["state_sha"] == whole["state_sha"], f"rank {rank}: resumed state differs"
        assert resumed["loss"] == whole["loss"], (resumed, whole)
        assert first["state_sha"] != whole["state_sha"]
        assert "zero=1" in refused["error"] and "HINT: resume with zero=1" in refused["error"], refused
        shas.add(whole["state_sha"])
    assert len(shas) == 4  # each rank saved its own slice of the optimizer state (and its tensor shard)


# -- refusals, and one process ---------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("strategy", ["Hybrid", "Pipeline", "TensorParallel"])
def test_zero_stages_2_and_3_on_the_data_axis_are_refused_by_name(strategy, zero):
    sizes = {"Pipeline": {"stages": 1}, "TensorParallel": {"size": 1}, "Hybrid": {}}[strategy]
    with pytest.raises(
        ValueError, match=rf"zero=0 or zero=1, got zero={zero}\. Stages 2 and 3 .*ShardedData"
    ):
        getattr(loom, strategy)(**sizes, zero=zero)


@pytest.mark.unit
@pytest.mark.parametrize("zero", [True, -1, "1", 1.5])
def test_other_zero_values_are_refused(zero):
    with pytest.raises(ValueError, match="zero=0 or zero=1, got zero="):
        DataAxisConfig(zero=zero)


@pytest.mark.unit
def test_zero_1_refuses_compression():
    with pytest.raises(ValueError, match="zero=1 does not take compression='int8'"):
        loom.Hybrid(dp=2, zero=1, compression="int8")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_non_elementwise_optimizer_is_refused():
    model = _model()
    optimizer = torch.optim.Adafactor(model.parameters())
    with pytest.raises(ValueError, match="a data axis with zero=1 .* got Adafactor. HINT: .*or zero=0"):
        loom.Hybrid(zero=1).setup(model, optimizer, nn.functional.mse_loss)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_one_process_zero_1_trains_as_zero_0_and_refuses_another_cut():
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 2))
    results = {}
    for zero in (0, 1):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        job = loom.Hybrid(zero=zero).setup(model, optimizer, nn.functional.mse_loss)
        losses = [job.train_step(batch) for batch in job.loader(data, 6, seed=2)]
        results[zero] = losses, job.full_state_dict(), job
    (losses0, params0, job0), (losses1, params1, job1) = results[0], results[1]
    assert losses0 == losses1
    assert all(torch.equal(params0[k], params1[k]) for k in params0)
    state = job1.state_dict()
    assert state["shard"]["zero"] == 1 and state["data_axis"]["sharded"]["dp"] == 1
    job1.load_state_dict(state)  # its own state round-trips
    assert job1.step == 4
    state["data_axis"]["sharded"] = dict(state["data_axis"]["sharded"], dp=2, hi=7)
    with pytest.raises(ValueError, match=r"'dp': 2.*this job's is cut as \{'zero': 1, 'dp': 1.*dp=2"):
        job1.load_state_dict(state)
    with pytest.raises(
        ValueError, match="written with zero=1 .* this job has zero=0. HINT: resume with zero=1"
    ):
        job0.load_state_dict(job1.state_dict())


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_skipped_step_leaves_no_gradient_behind_with_zero_1():
    """The optimizer holds slices, so its zero_grad misses the stage's own gradients: the job clears them, and
    a NaN step skipped under zero=1 ends as under zero=0 (finite, the same parameters)."""
    x, y = torch.randn(24, 4), torch.randn(24, 2)
    x[8] = float("nan")  # the second batch of 6 (shuffle=False)
    data = torch.utils.data.TensorDataset(x, y)
    ends = {}
    for zero in (0, 1):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        job = loom.Hybrid(zero=zero).setup(model, optimizer, nn.functional.mse_loss)
        for batch in job.loader(data, 6, shuffle=False):
            job.train_step(batch)
        assert job.skipped_steps == 1, zero
        ends[zero] = job.full_state_dict()
    for key, value in ends[0].items():
        assert torch.isfinite(ends[1][key]).all() and torch.equal(value, ends[1][key]), key


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("collective", ["reduce_scatter", "native", "ring"])
def test_the_sharded_axis_over_an_explicit_group_equals_one_model(collective):
    """ShardedDataAxis over a 2-rank group (ranks as threads): each rank's half of the batch, 3 steps of SGD with
    momentum, equals one model on the whole batches; each rank's momentum covers its piece only."""
    from threads import run_ranks

    from loom.parallel.data.sharded_axis import ShardedDataAxis
    from loom.parallel.data.sharded_flat import FlatShards

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    reference = _model()
    optimizer = sgd(reference)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()

    initial = _model()  # built once: the global RNG is shared by the threads, so seeding in each would race

    def rank_fn(rank, group):
        model = copy.deepcopy(initial)
        optimizer = sgd(model)
        axis = ShardedDataAxis(
            DataAxisConfig(zero=1), FlatShards.over_group(model, optimizer, group, collective), rank
        )
        for x, y in batches:  # equal halves: the average of the halves' mean gradients is the whole batch's
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x[4 * rank : 4 * rank + 4]), y[4 * rank : 4 * rank + 4]).backward()
            axis.average(list(model.parameters()))
            optimizer.step()
            axis.gather_parameters()
        momentum = sum(s["momentum_buffer"].numel() for s in optimizer.state.values())
        return model.state_dict(), momentum, axis.layout()

    results = run_ranks(2, rank_fn)
    total = sum(p.numel() for p in reference.parameters())
    assert [r[1] for r in results] == [total // 2, total - total // 2]
    assert [r[2]["lo"] for r in results] == [0, total // 2]
    for state, _, _ in results:
        for key, value in reference.state_dict().items():
            assert (state[key] - value).abs().max() <= 1e-6, key
