"""What the gossip workers share with each other and with tests/test_gossip.py (imported, not run on its own):
the tiny model each rank builds, its parameters as one list, and a guard that makes every collective of
torch.distributed raise inside a training loop."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "reduce_scatter", "all_to_all", "gather",
               "scatter", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_object",
               "broadcast_object_list", "send", "recv", "isend", "irecv")  # fmt: skip


class NoCollectives:
    """Inside the block every collective (and gloo point-to-point call) of torch.distributed raises."""

    def __enter__(self) -> None:
        self.saved = {name: getattr(dist, name) for name in COLLECTIVES}
        for name in COLLECTIVES:
            setattr(dist, name, self._refuse(name))

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    @staticmethod
    def _refuse(name: str):
        def refuse(*args, **kwargs):
            raise AssertionError(f"torch.distributed.{name} called in the training loop")

        return refuse


def build(rank: int, fill: float | None = None, lr: float = 0.0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Rank ``rank``'s own initial model (or every parameter ``fill``), and an SGD optimizer of rate ``lr``."""
    torch.manual_seed(10 + rank)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    if fill is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(fill)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9 if lr else 0.0)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def dataset(n: int = 48) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g))
