"""Model-parallel strategies under ``loom run --max-restarts 3``, each losing a worker to SIGKILL once.

``fit_strategies_elastic.py ROOT STEPS KILL_AT`` (tests/test_fit_strategies.py): runs loom.fit for Pipeline,
TensorParallel and Hybrid in turn, checkpointing into ROOT/<name> every 3 steps. On attempt i
(TORCHELASTIC_RESTART_COUNT) the last rank kills itself with SIGKILL just before step KILL_AT of strategy i
(KILL_AT 0: never), so each strategy is restarted once; the strategies before it resume from their final
checkpoint and take no step. Prints one JSON line per rank and strategy, with the attempt.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from common import make_dataset
from faults import Fault, Injector
from pp_common import make_deep_mlp
from torch import nn

import loom
from loom.checkpoint import pack_state

root, steps, kill_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
topo = loom.init()
STRATEGIES = {
    "pipeline": lambda: loom.Pipeline(stages=2, microbatches=2),
    "tp": lambda: loom.TensorParallel(size=2),
    "hybrid": lambda: loom.Hybrid(dp=topo.world_size // 2, pp=2, microbatches=2, allreduce="ring"),
}
for index, (name, make) in enumerate(STRATEGIES.items()):
    model = make_deep_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    job = make().setup(model, optimizer, nn.functional.mse_loss)
    train_step = job.train_step
    # the last rank dies before step KILL_AT of the strategy whose index is the restart attempt
    faults = Injector(
        topo.rank, [Fault("kill", topo.world_size - 1, kill_at, attempt=index)] if kill_at else [], attempt
    )

    def step_or_die(batch, job=job, train_step=train_step, faults=faults):
        faults.before_step(job.step + 1)
        return train_step(batch)

    job.train_step = step_or_die  # type: ignore[method-assign]
    result = loom.fit(
        job, job.loader(make_dataset(), 10, seed=1), steps=steps, checkpoint_dir=root / name,
        checkpoint_every=3, keep=5, progress=False,
    )  # fmt: skip
    state = job.state_dict()
    digest = hashlib.sha256(
        pack_state({"model": state["model"], "optimizer": state["optimizer"]})
    ).hexdigest()
    record = {"rank": topo.rank, "strategy": name, "attempt": attempt, "steps": result.steps,
              "resumed_from": result.resumed_from, "state_sha": digest}  # fmt: skip
    print(json.dumps(record), flush=True)
