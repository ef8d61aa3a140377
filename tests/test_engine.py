"""The step engine (`loom.train.engine`): one `train_step` for every strategy, so ``accumulate`` and the
`loom.LossCall` conventions reach every strategy whose replicas step on their own share (LocalSGD, DiLoCo,
Gossip, ParameterServer), as they reached DataParallel; unknown options are refused by name.

In one process (``topology=SINGLE``), against a plain loop on the same batches (parameter servers: two real
server processes on loopback)."""

from __future__ import annotations

import pytest
import torch
from ps_helpers import parameter_servers
from torch import nn

import loom
from loom.topology import Topology
from loom.train.engine import Engine

SINGLE = Topology(0, 1, 0, 1, "none")
STEPS, BATCH = 4, 10  # 10 samples in 3 micro-batches: 4, 3, 3 (uneven pieces)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 2, generator=g)) for _ in range(STEPS)]


def make_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


class OwnLoss(nn.Module):
    """A model that returns its own loss (``loss_fn=None``: called as ``model(*batch)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def reference() -> tuple[list[float], list[torch.Tensor]]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in data():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def run(strategy, convention: str) -> tuple[list[float], list[torch.Tensor]]:
    model = OwnLoss() if convention == "own loss" else make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = {
        "plain": nn.functional.mse_loss,
        "own loss": None,
        "whole batch": loom.LossCall(
            lambda out, batch: nn.functional.mse_loss(out, batch[1]), whole_batch=True
        ),
    }[convention]
    job = strategy.setup(model, optimizer, loss_fn)
    assert isinstance(job, Engine)
    losses = [job.train_step(batch) for batch in data()]
    evaluated = job.eval_step(data()[0])["loss"]
    want = nn.functional.mse_loss(make_model().eval()(data()[0][0]), data()[0][1])  # a fresh model: differs
    assert evaluated != pytest.approx(want.item())  # the trained model was evaluated
    close = getattr(job, "close", None)
    if close is not None:
        close()
    return losses, [p.detach().clone() for p in model.parameters()]


STRATEGIES = {
    "DataParallel": lambda **o: loom.DataParallel(topology=SINGLE, observe=False, **o),
    "LocalSGD": lambda **o: loom.LocalSGD(sync_every=2, topology=SINGLE, observe=False, **o),
    "DiLoCo": lambda **o: loom.DiLoCo(
        sync_every=2,
        outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0),
        topology=SINGLE,
        observe=False,
        **o,
    ),
    "Gossip": lambda **o: loom.Gossip(topology=SINGLE, **o),
}


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("convention", ["plain", "own loss", "whole batch"])
def test_accumulate_and_conventions_equal_a_plain_loop(name, accumulate, convention):
    want_losses, want_params = reference()
    losses, params = run(STRATEGIES[name](accumulate=accumulate), convention)
    assert losses == pytest.approx(want_losses, abs=1e-6), (name, accumulate, convention)
    for got, want in zip(params, want_params, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parameter_server_accumulates_and_takes_the_conventions(mode):
    want_losses, want_params = reference()
    with parameter_servers(2) as servers:
        for i, (accumulate, convention) in enumerate([(3, "plain"), (1, "own loss"), (3, "whole batch")]):
            strategy = loom.ParameterServer(
                topology=SINGLE, addresses=tuple(servers.addresses), secret=servers.secret, mode=mode,
                namespace=f"engine-{mode}-{i}", accumulate=accumulate,
            )  # fmt: skip
            losses, params = run(strategy, convention)
            label = (mode, accumulate, convention)
            assert losses == pytest.approx(want_losses, abs=1e-5), label
            for got, want in zip(params, want_params, strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy", [loom.LocalSGD, loom.DiLoCo, loom.Gossip, loom.ParameterServer])
def test_a_misspelt_option_is_refused_naming_it_and_the_options(strategy):
    with pytest.raises(TypeError, match=r"does not take 'acumulate'\. Its options: accumulate, "):
        strategy(acumulate=2)
    with pytest.raises(ValueError, match="accumulate must be an int >= 1, got 0"):
        strategy(accumulate=0)
