"""A NaN input on one rank at step NAN_AT under loom.fit with checkpoints (tests/test_nonfinite.py).

``nonfinite_fit.py STRATEGY POLICY DIR [NAN_AT]``: STRATEGY is ``dp`` (DataParallel), ``pipeline``
(Pipeline(stages=2)) or ``tp`` (TensorParallel(size=2)); POLICY is ``skip`` or ``stop``. One sample's input is set to NaN on BAD_RANK at step
NAN_AT (for the pipeline, rank 0: the first stage is the one that reads inputs). Trains 20 steps with
checkpoint_every=5, keep=3, and prints one JSON line per rank: whether its parameters are finite, the skipped
steps as its step records show them, the job's and fit's counts, the error raised (if any), and for every kept
checkpoint whether rank 0's view of its tensors is finite.
"""

import json
import sys

import torch
from common import make_dataset
from faults import Fault, Injector
from pp_common import make_deep_mlp
from torch import nn

import loom
from loom.checkpoint import list_checkpoints, read_checkpoint, read_local_state
from loom.fault.desync import NonFiniteStepError

strategy_name, policy, directory = sys.argv[1:4]
nan_at = int(sys.argv[4]) if len(sys.argv) > 4 else 10
topo = loom.init()
model = make_deep_mlp()
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
if strategy_name == "dp":
    strategy, bad_rank = loom.DataParallel(nonfinite=policy), 1
elif strategy_name == "tp":  # the tensor shards of a stage share no group the loss travels on
    strategy, bad_rank = loom.TensorParallel(size=2, nonfinite=policy), 1
else:  # with 4 processes: dp=2 x pp=2
    strategy, bad_rank = loom.Pipeline(stages=2, microbatches=2, nonfinite=policy), 0
job = strategy.setup(model, optimizer, nn.functional.mse_loss)
train_step = job.train_step


faults = Injector(topo.rank, [Fault("nan", bad_rank, nan_at)])


def poisoned_step(batch):
    faults.before_step(job.step + 1, batch)  # in place: the batch keeps its layout (global size, fingerprint)
    return train_step(batch)


job.train_step = poisoned_step
loader = job.loader(make_dataset(), 6, seed=0)
result, error = None, ""
try:
    result = loom.fit(
        job, loader, steps=20, checkpoint_dir=directory, checkpoint_every=5, keep=3, progress=False
    )
except NonFiniteStepError as err:
    error = str(err)


def finite(state) -> bool:
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, dict):
        return all(finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(finite(v) for v in state)
    return True


kept = {}
for step, path in list_checkpoints(directory).items():
    _, state = read_checkpoint(path)
    mine = state["job"] if state["job"] is not None else read_local_state(path, topo.rank)["job"]
    kept[step] = finite(mine)
print(
    json.dumps(
        {
            "rank": topo.rank,
            "params_finite": all(bool(torch.isfinite(p).all()) for p in job.module.parameters()),
            "skipped_in_records": [r.step for r in job.metrics.records if r.skipped],
            "job_skipped": job.skipped_steps,
            "fit_skipped": result.skipped_steps if result is not None else None,
            "steps": job.step,
            "error": error,
            "checkpoints": kept,
        }
    ),
    flush=True,
)
