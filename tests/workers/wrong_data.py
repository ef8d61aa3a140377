"""Model-parallel jobs fed data sharded over the wrong axis (tests/test_fit_strategies.py).

``wrong_data.py``: on 2 processes, for a Pipeline(stages=2) and a TensorParallel(size=2) job: (1) the usual
world-sharded ``loom.data.loader(dataset, ...)`` instead of ``job.loader(...)``; (2) plain tuples that differ
between the ranks of the replica. Prints one JSON line per case: whether the step raised, its message, and
whether the parameters stayed untouched.
"""

import json

import torch
from common import make_dataset
from pp_common import make_deep_mlp
from torch import nn

import loom

topo = loom.init()
for name, make in (
    ("pipeline", lambda: loom.Pipeline(stages=2)),
    ("tp", lambda: loom.TensorParallel(size=2)),
):
    for case in ("world_loader", "rank_tuples"):
        model = make_deep_mlp()
        job = make().setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)
        before = {k: v.clone() for k, v in job.module.named_state().items()}
        if case == "world_loader":
            batch = next(iter(loom.data.loader(make_dataset(), 10, seed=1)))  # sharded over the world
        else:
            g = torch.Generator().manual_seed(topo.rank)  # each rank its own samples
            batch = (torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g))
        try:
            job.train_step(batch)
            raised = ""
        except ValueError as error:
            raised = str(error)
        untouched = all(torch.equal(before[k], v) for k, v in job.module.named_state().items())
        print(json.dumps({"rank": topo.rank, "strategy": name, "case": case, "raised": raised,
                          "untouched": untouched}), flush=True)  # fmt: skip
