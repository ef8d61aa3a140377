"""Each strategy's exactness on ranks as threads (issue 39, item 4): a job built on a `Topology` that carries its
own process group (`tests/threads.py`: one explicit gloo group per thread, no default group) trains a few steps
and equals one process on the same global batches, within the tolerance of the multi-process exactness tests
(1e-5: tests/test_data_parallel.py, test_local_sgd.py, test_diloco.py, test_sharded.py, test_pipeline.py,
test_tensor_parallel.py). A collective that reached for the default group would fail here ("Default process
group has not been initialized"); one that fell back to a group of one would train each rank alone and differ."""

from __future__ import annotations

import copy

import pytest
import torch
from threads import run_ranks
from torch import nn
from workers.common import make_dataset, make_mlp, make_optimizer, reference_run
from workers.pp_common import deep_reference, make_deep_mlp

import loom
from loom.mesh import Mesh
from loom.topology import Topology

pytestmark = pytest.mark.unit

TOL = 1e-5
GLOBAL_BATCH = 10
STEPS = 4
DATA = make_dataset()
MLP = make_mlp()  # built here: torch's default generator is shared by the threads
DEEP_MLP = make_deep_mlp()


def _topology(rank: int, world: int, group) -> Topology:
    return Topology(rank, world, rank, world, "gloo", process_group=group)


def _train(job, topology: Topology | None = None, steps: int = STEPS) -> list[float]:
    """``steps`` steps on the loader's global batches (the job's data topology)."""
    loader = loom.data.loader(DATA, GLOBAL_BATCH, seed=1, topology=topology or job.data_topology)
    losses = []
    for batch in loader:
        losses.append(job.train_step(batch))
        if len(losses) == steps:
            return losses
    raise AssertionError(f"the loader ended after {len(losses)} steps")


def _assert_equal_to_one_process(results, reference, label: str) -> None:
    """Every rank's losses, and each returned whole model (None: not this rank's to return), within `TOL`."""
    ref_losses, ref_params = reference
    for rank, (losses, params) in enumerate(results):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= TOL, f"{label} rank {rank}"
        if params is not None:
            assert params.keys() == ref_params.keys(), f"{label} rank {rank}"
            for name, ref in ref_params.items():
                diff = (params[name] - ref).abs().max().item()
                assert diff <= TOL, f"{label} rank {rank}: {name} differs by {diff}"


def _plain_sgd_reference(steps: int = STEPS):
    """One process, whole global batches, SGD without momentum (what LocalSGD and DiLoCo at ``sync_every=1``
    equal, as in tests/workers/local_sgd_exact.py)."""
    model = copy.deepcopy(MLP)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in loom.data.loader(DATA, GLOBAL_BATCH, seed=1, topology=Topology(0, 1, 0, 1, "none")):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if len(losses) == steps:
            break
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "allreduce"), [(2, "native"), (3, "shm"), (3, "ring")])
def test_data_parallel_on_threads_equals_one_process(world, allreduce):
    """DDP over the group (``native``: its own all-reduce; ``ring``: loom's, in DDP's hook over DDP's group) and
    the shared-memory path (``shm``, no DDP) equal one process, SGD with momentum."""

    def rank_fn(rank, group):
        model = copy.deepcopy(MLP)
        strategy = loom.DataParallel(
            topology=_topology(rank, world, group), allreduce=allreduce, overlap=False, observe=False
        )
        job = strategy.setup(model, make_optimizer("sgd", model), nn.functional.mse_loss)
        assert (job.shared_gradients is not None) == (allreduce == "shm")
        losses = _train(job)
        return losses, {k: v.detach().clone() for k, v in job.module.state_dict().items()}

    results = run_ranks(world, rank_fn)
    _assert_equal_to_one_process(
        results, reference_run("sgd", GLOBAL_BATCH, STEPS), f"DataParallel {allreduce}"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["LocalSGD native", "LocalSGD ring", "DiLoCo native"])
def test_local_sgd_and_diloco_syncing_every_step_on_threads_equal_one_process(case):
    """``sync_every=1`` (DiLoCo with an outer SGD of lr 1) is synchronous SGD: it equals one process."""
    name, allreduce = case.split()

    def rank_fn(rank, group):
        topology = _topology(rank, 2, group)
        if name == "LocalSGD":
            strategy = loom.LocalSGD(sync_every=1, allreduce=allreduce, topology=topology, observe=False)
        else:
            outer = lambda params: torch.optim.SGD(params, lr=1.0)  # noqa: E731
            strategy = loom.DiLoCo(
                sync_every=1, allreduce=allreduce, outer_optimizer=outer, topology=topology, observe=False
            )
        model = copy.deepcopy(MLP)
        job = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)
        try:
            losses = _train(job, job.data_topology)
        finally:
            if name == "DiLoCo":
                job.close()  # its communication thread
        return losses, {k: v.detach().clone() for k, v in job.module.state_dict().items()}

    _assert_equal_to_one_process(run_ranks(2, rank_fn), _plain_sgd_reference(), case)


@pytest.mark.timeout(60)
def test_diloco_overlap_on_a_topology_with_one_group_is_refused():
    """Overlapped exchanges need a group of their own beside the steps' (``new_group`` of the default group);
    a topology bringing one process group cannot give one, so overlap is refused, not run on a shared group."""

    def rank_fn(rank, group):
        model = copy.deepcopy(MLP)
        strategy = loom.DiLoCo(
            sync_every=4, fragments=2, overlap_steps=1, topology=_topology(rank, 2, group), observe=False
        )
        with pytest.raises(ValueError, match=r"overlap_steps=1\).*HINT: overlap_steps=0"):
            strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)

    run_ranks(2, rank_fn)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "gradient_reduce"), [(2, "all_reduce"), (3, "reduce_scatter")])
def test_sharded_stage_1_on_threads_equals_one_process(world, gradient_reduce):
    """Stage 1 (loom's flat optimizer shards, Adam): each rank's optimizer holds its piece only, and every
    rank's whole model equals one process."""

    def rank_fn(rank, group):
        model = copy.deepcopy(MLP)
        strategy = loom.ShardedDataParallel(
            stage=1, gradient_reduce=gradient_reduce, topology=_topology(rank, world, group), observe=False
        )
        optimizer = make_optimizer("adam", model)
        job = strategy.setup(model, optimizer, nn.functional.mse_loss)
        losses = _train(job)
        held = sum(s["exp_avg"].numel() for s in optimizer.state.values())
        whole = {
            k: v.detach().clone() for k, v in job.module.state_dict().items()
        }  # ZeRO-1: whole everywhere
        return (losses, whole), held

    results = run_ranks(world, rank_fn)
    total = sum(p.numel() for p in MLP.parameters())
    assert sum(held for _, held in results) == total and max(held for _, held in results) < total
    _assert_equal_to_one_process(
        [r for r, _ in results],
        reference_run("adam", GLOBAL_BATCH, STEPS),
        f"ShardedDataParallel {gradient_reduce}",
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stages", "schedule"), [(2, "gpipe"), (2, "1f1b"), (3, "1f1b")])
def test_pipeline_on_threads_equals_one_process(stages, schedule):
    """Stages exchange activations and gradients point to point over the job's group (4 micro-batches, Adam)."""

    def rank_fn(rank, group):
        model = copy.deepcopy(DEEP_MLP)
        mesh = Mesh(pp=stages, topology=_topology(rank, stages, group))
        strategy = loom.Pipeline(stages=stages, microbatches=4, schedule=schedule, mesh=mesh)
        job = strategy.setup(model, make_optimizer("adam", model), nn.functional.mse_loss)
        return _train(job, steps=3), job.full_state_dict()

    results = run_ranks(stages, rank_fn)
    assert results[0][1] is not None and all(params is None for _, params in results[1:])
    _assert_equal_to_one_process(results, deep_reference("adam", GLOBAL_BATCH, 3), f"Pipeline {schedule}")


@pytest.mark.timeout(120)
def test_tensor_parallel_on_threads_equals_one_process():
    """The MLP split over 2 ranks (column- then row-parallel): each rank holds half of each weight; the whole
    model gathered on rank 0 equals one process (Adam)."""

    def rank_fn(rank, group):
        model = copy.deepcopy(MLP)
        strategy = loom.TensorParallel(size=2, topology=_topology(rank, 2, group))
        job = strategy.setup(model, make_optimizer("adam", model), nn.functional.mse_loss)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        return (_train(job, steps=3), job.full_state_dict()), shapes

    results = run_ranks(2, rank_fn)
    for _, shapes in results:
        assert shapes["0.weight"] == (8, 8) and shapes["2.weight"] == (4, 8), (
            shapes
        )  # halves of (16, 8), (4, 16)
    assert results[0][0][1] is not None
    _assert_equal_to_one_process(
        [r for r, _ in results], reference_run("adam", GLOBAL_BATCH, 3), "TensorParallel"
    )
