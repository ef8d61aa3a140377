"""ShardedDataParallel without processes: one-process exactness, state round trip, self-test, refusals."""

import pytest
import torch
from torch import nn
from workers.common import make_dataset, make_mlp, make_optimizer, reference_run

import loom
from loom.checkpoint.sharded_state import full_state_dict
from loom.parallel.data.sharded_fsdp import default_units
from loom.parallel.data.sharded_memory import live_tensor_bytes, zero_share
from loom.parallel.data.sharded_selftest import check_collectives
from loom.topology import Topology

pytestmark = pytest.mark.unit  # the lane (main's conftest refuses a test without one)

SINGLE = Topology(0, 1, 0, 1, "none")


def _train(stage: int, optimizer: str, steps: int, accumulate: int = 1):
    model = make_mlp()
    job = loom.ShardedDataParallel(stage=stage, accumulate=accumulate, topology=SINGLE).setup(
        model, make_optimizer(optimizer, model), nn.functional.mse_loss
    )
    loader = loom.data.loader(make_dataset(), 10, seed=1, topology=SINGLE)
    losses = []
    while len(losses) < steps:
        for batch in loader:
            losses.append(job.train_step(batch))
            if len(losses) == steps:
                break
    return job, losses


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_process_equals_reference(stage):
    job, losses = _train(stage, "adam", 6, accumulate=2)
    ref_losses, ref_params = reference_run("adam", 10, 6)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    for name, ref in ref_params.items():
        torch.testing.assert_close(job.module.state_dict()[name], ref, atol=1e-6, rtol=0)


def test_state_round_trip_and_full_state_dict():
    job, _ = _train(1, "adam", 4)
    state = job.state_dict()
    assert set(state["optimizer"]["sharded"]["0.weight"]) == {"exp_avg", "exp_avg_sq"}
    full = full_state_dict([state])
    for name, value in job.module.state_dict().items():
        torch.testing.assert_close(full[name], value, atol=0, rtol=0)
    fresh, _ = _train(1, "adam", 0)
    fresh.load_state_dict({k: v for k, v in state.items()})
    assert fresh.step == 4
    for name, value in job.module.state_dict().items():
        torch.testing.assert_close(fresh.module.state_dict()[name], value, atol=0, rtol=0)
    x, y = make_dataset().tensors
    assert fresh.train_step((x[:10], y[:10])) == job.train_step((x[:10], y[:10]))
    torch.testing.assert_close(fresh.module.state_dict(), job.module.state_dict(), atol=0, rtol=0)


def test_full_state_dict_refuses_missing_part():
    job, _ = _train(1, "sgd", 1)
    state = job.state_dict()
    state["params"]["0.weight"]["hi"] -= 1
    state["params"]["0.weight"]["value"] = state["params"]["0.weight"]["value"][:-1]
    with pytest.raises(ValueError, match="0.weight"):
        full_state_dict([state])


def test_self_test_refuses_a_summing_backend():
    world = 3
    means, sums = [], []
    for rank in range(world):  # simulate each rank: every contribution is known from the rank alone

        def contribution(r: int, n: int) -> torch.Tensor:
            return torch.arange(n, dtype=torch.float32) + 1000.0 * (r + 1)

        def averaging(t, rank=rank):
            from loom.comm.shards import piece_bounds

            total = sum(contribution(r, t.numel()) for r in range(world))
            lo, hi = piece_bounds(t.numel(), rank, world)
            return (total / world)[lo:hi]

        def summing(t, rank=rank):
            return averaging(t, rank) * world

        def gather(piece, n, rank=rank):
            base = torch.arange(n, dtype=torch.float32) + 500.0 * (world + 1)
            return base

        means.append(check_collectives(rank, world, averaging, gather))
        sums.append(check_collectives(rank, world, summing, gather))
    assert means == [[], [], []]
    assert all(p and "sum over the ranks" in p[0] for p in sums)


def test_refusals():
    with pytest.raises(ValueError, match="stage"):
        loom.ShardedDataParallel(stage=4)
    with pytest.raises(ValueError, match="compression"):
        loom.ShardedDataParallel(compression="fp16")
    model = make_mlp()
    with pytest.raises(ValueError, match="elementwise"):
        loom.ShardedDataParallel(topology=SINGLE).setup(model, torch.optim.LBFGS(model.parameters()), None)


def test_default_units():
    mlp = make_mlp()
    assert default_units(mlp) == [mlp[0], mlp[2]]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(2, 4)
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)) for _ in range(3)])

    net = Net()
    assert default_units(net) == list(net.blocks)


def test_memory_in_one_process_is_the_whole_state():
    job, _ = _train(3, "adam", 2)
    n = sum(p.numel() for p in job.module.parameters())
    memory = live_tensor_bytes(job.module, job.optimizer)
    assert memory["parameters"] == 4 * n and memory["gradients"] == 4 * n
    assert 8 * n <= memory["optimizer"] <= 8 * n + 64  # Adam's moments, plus its step counters
    assert memory["state"] <= 1.10 * zero_share(3, 1) * 16 * n
    assert zero_share(1, 4) == pytest.approx((4 + 4 + 2) / 16)
    assert zero_share(2, 4) == pytest.approx((4 + 3) / 16)


def test_tied_parameters_export_under_both_names():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 4, bias=False)
            self.head = nn.Linear(4, 4, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.tensor([2.0]))

        def forward(self, x):
            return self.head(torch.tanh(self.embed(x))) * self.scale

    torch.manual_seed(0)
    model = Tied()
    job = loom.ShardedDataParallel(topology=SINGLE).setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss
    )
    job.train_step((torch.randn(6, 4), torch.randn(6, 4)))
    full = full_state_dict([job.state_dict()])
    fresh = Tied()
    fresh.load_state_dict(full, strict=True)
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), atol=0, rtol=0)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_mixed_precision_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="stage=1\\) does not take mixed_precision='bf16'"):
        loom.ShardedDataParallel(stage=1, mixed_precision="bf16")
    with pytest.raises(
        ValueError,
        match="mixed_precision must be one of None, 'bf16', 'fp16', got 'fp8'. HINT: 'bf16' computes in bfloat16",
    ):
        loom.ShardedDataParallel(stage=3, mixed_precision="fp8")
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="needs FSDP2 units sharded over 2 or more processes"):
        loom.ShardedDataParallel(stage=3, mixed_precision="bf16", topology=SINGLE, observe=False).setup(
            model, torch.optim.Adam(model.parameters()), nn.functional.mse_loss
        )
