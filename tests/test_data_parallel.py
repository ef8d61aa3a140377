"""DataParallel equals one process on the same global batches, with uneven and empty shares."""

import json

import pytest
import torch
from torch import nn
from workers.common import make_dataset, make_mlp, make_optimizer, reference_run

import loom
from loom.topology import Topology

SINGLE = Topology(0, 1, 0, 1, "none")


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world_size", "global_batch", "allreduce"),
    [
        (2, 10, "native"),
        (3, 10, "native"),
        (4, 10, "native"),
        (4, 3, "native"),
        (3, 10, "ring"),
        (3, 10, "driver"),
        (2, 10, "shm"),
        (4, 3, "auto"),
        (3, 10, "hierarchical"),
    ],
)
def test_matches_one_process(workers, world_size, global_batch, allreduce):
    """Shared-memory algorithms on one CPU host without a spare core average the gradients in shared memory
    (`loom.comm.shared_gradients`), the others through DDP; both equal one process."""
    steps = 10
    outputs = workers("dp_exact.py", world_size, str(global_batch), str(steps), allreduce, timeout=150)
    refs = {opt: reference_run(opt, global_batch, steps) for opt in ("sgd", "adam")}
    for rank, out in enumerate(outputs):
        runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(runs) == 4, f"rank {rank} printed {len(runs)} runs"
        for run in runs:
            ref_losses, ref_params = refs[run["optimizer"]]
            label = f"rank {rank} {run['optimizer']} accumulate={run['accumulate']}"
            assert run["shared_gradients"] == (allreduce in ("shm", "auto", "hierarchical")), label
            assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True)) <= 1e-5, label
            for name, ref in ref_params.items():
                got = torch.tensor(run["params"][name]).view_as(ref)
                assert (got - ref).abs().max().item() <= 1e-5, f"{label}: {name}"


@pytest.mark.unit
def test_single_process_without_launcher_matches_reference():
    data = make_dataset()
    model = make_mlp()
    job = loom.DataParallel(topology=SINGLE).setup(
        model, make_optimizer("adam", model), nn.functional.mse_loss
    )
    loader = loom.data.loader(data, 10, seed=1, topology=SINGLE)
    losses = [job.train_step(b) for b in loader]
    ref_losses, ref_params = reference_run("adam", 10, len(losses))
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    for name, ref in ref_params.items():
        torch.testing.assert_close(job.module.state_dict()[name], ref, atol=1e-6, rtol=0)


@pytest.mark.unit
def test_plain_tuple_batch_and_eval_step():
    data = make_dataset()
    model = make_mlp()
    job = loom.DataParallel(topology=SINGLE).setup(
        model, make_optimizer("sgd", model), nn.functional.mse_loss
    )
    x, y = data.tensors
    loss = job.train_step((x[:10], y[:10]))
    assert isinstance(loss, float)
    result = job.eval_step((x, y), metrics={"mae": lambda out, t: (out - t).abs().mean()})
    with torch.no_grad():
        out = job.module(x)
    assert result["loss"] == pytest.approx(nn.functional.mse_loss(out, y).item(), rel=1e-6)
    assert result["mae"] == pytest.approx((out - y).abs().mean().item(), rel=1e-6)
    assert job.metrics.records[-1].samples == 10


@pytest.mark.unit
def test_state_dict_round_trip():
    data = make_dataset()
    model = make_mlp()
    job = loom.DataParallel(topology=SINGLE).setup(
        model, make_optimizer("adam", model), nn.functional.mse_loss
    )
    x, y = data.tensors
    job.train_step((x, y))
    state = job.state_dict()
    other_model = make_mlp()
    other = loom.DataParallel(topology=SINGLE).setup(
        other_model, make_optimizer("adam", other_model), nn.functional.mse_loss
    )
    other.load_state_dict(state)
    assert other.step == 1
    assert job.train_step((x, y)) == other.train_step((x, y))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"accumulate": 0}, "accumulate must be an int >= 1"), ({"bucket_cap_mb": -1}, "bucket_cap_mb")],
)
def test_bad_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        loom.DataParallel(**kwargs)


@pytest.mark.unit
def test_bad_setup_arguments_are_refused():
    model = make_mlp()
    strategy = loom.DataParallel(topology=SINGLE)
    with pytest.raises(TypeError, match="nn.Module"):
        strategy.setup("model", make_optimizer("sgd", model), nn.functional.mse_loss)
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="not in the model"):
        strategy.setup(model, stranger, nn.functional.mse_loss)
    job = strategy.setup(model, make_optimizer("sgd", model), nn.functional.mse_loss)
    with pytest.raises(TypeError, match=r"a pair \(inputs, targets\), got Tensor"):
        job.train_step(torch.zeros(3, 8))


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_model_that_differs_across_ranks_is_refused_on_every_rank(workers):
    outputs = workers("dp_mismatch.py", 3, timeout=45)
    for out in outputs:
        assert "REFUSED" in out, out
        assert "rank 0 vs rank 2" in out
        assert "'0.weight'" in out and "[16, 8]" in out and "[17, 8]" in out
        assert "ranks that differ from rank 0: [2]" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_compression_plugs_into_data_parallel(workers):
    outputs = workers("dp_compress.py", 2, timeout=100)
    runs = {r["spec"]: r for r in (json.loads(ln) for ln in outputs[0].splitlines() if ln.startswith("{"))}
    ref_losses, ref_params = reference_run("sgd", 10, 10)
    exact = runs[None]
    assert max(abs(a - b) for a, b in zip(exact["losses"], ref_losses, strict=True)) <= 1e-5
    fp16 = runs["fp16"]  # fp16 rounding of the averaged gradient only: close to exact
    for name, ref in ref_params.items():
        assert (torch.tensor(fp16["params"][name]).view_as(ref) - ref).abs().max().item() <= 1e-2, name
    int8 = runs[
        "int8"
    ]  # int8 rounding (half a step of each chunk's scale) of each rank's share: close to exact
    off = max(
        (torch.tensor(int8["params"][n]).view_as(r) - r).abs().max().item() for n, r in ref_params.items()
    )
    assert 0 < off <= 5e-2, off  # not 0: the codec really ran
    for spec in ("powersgd:2", "topk:0.1"):
        run = runs[spec]
        assert run["has_state"], f"{spec} keeps error-feedback state per rank"
        float32_bytes = 2 * runs["fp16"]["bytes_sent"]  # what an uncompressed all-reduce sends
        assert run["bytes_sent"] < float32_bytes, spec
        assert run["losses"][-1] < run["losses"][0], f"{spec} does not train"


@pytest.mark.unit
def test_bad_compression_spec_is_refused():
    with pytest.raises(ValueError, match="topk:2.*valid forms are fp16, bf16, int8, topk"):
        loom.DataParallel(compression="topk:2")
    with pytest.raises(ValueError, match="cannot be combined"):
        loom.DataParallel(compression="fp16", allreduce="ring")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_overlap_follows_the_config_and_by_default_the_spare_cores(monkeypatch):
    from loom.parallel.data import data_parallel as dp
    from loom.parallel.data import data_parallel_sync as sync

    topo = Topology(0, 2, 0, 2, "gloo")

    def kind(**config) -> str:
        return sync.gradient_hook(dp.DataParallelConfig(allreduce="shm", **config), topo).__qualname__

    assert kind(overlap=True).startswith("overlapped_allreduce_hook")
    assert kind(overlap=False).startswith("allreduce_hook")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(sync.os, "sched_getaffinity", lambda _: {0, 1})
    assert kind().startswith("allreduce_hook")  # 2 processes x 1 thread on 2 cores: nothing to spare
    monkeypatch.setattr(sync.os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
    assert kind().startswith("overlapped_allreduce_hook")
    assert sync.gradient_hook(dp.DataParallelConfig(allreduce="native"), topo) is None
    # `auto` with a core to spare on one host: DDP's own all-reduce (loom's threaded one lost to it at 2-4 workers
    # on a 16-core host); without one, or told overlap=True, or across hosts: loom's
    assert sync.gradient_hook(dp.DataParallelConfig(), topo) is None
    assert "core to spare" in sync.native_because(dp.DataParallelConfig(), topo)
    assert sync.gradient_hook(dp.DataParallelConfig(overlap=True), topo).__qualname__.startswith("overlapped")
    two_hosts = Topology(0, 4, 0, 2, "gloo")
    assert sync.native_because(dp.DataParallelConfig(), two_hosts) is None
    monkeypatch.setattr(sync.os, "sched_getaffinity", lambda _: {0, 1})
    assert sync.native_because(dp.DataParallelConfig(), topo) is None
