"""A parameter-server training script for `loom run --servers K` tests (least squares, as in ps_train.py).

The argument is JSON: mode, staleness, steps, kill_rank/kill_step (SIGKILL itself before that step, on the first attempt
only when the job restarts), timeout_s (worker
timeout), slow_s (sleep per step, so that a kill lands mid-training). Before training every worker evaluates the
first global batch with `eval_step` (all workers hold the initial parameters then); at the end each writes
``$LOOM_RUN_DIR/result-<rank>.json`` with its losses, that evaluation and its per-step staleness records.

Run by tests/test_ps_launch.py.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from common import least_squares, train_steps
from faults import Fault, Injector
from torch import nn

import loom

cfg = json.loads(sys.argv[1])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
topo = loom.init()
torch.manual_seed(0)
model = nn.Linear(8, 1, bias=False)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
strategy = loom.ParameterServer(
    mode=cfg["mode"], staleness=cfg.get("staleness", 0), worker_timeout_s=cfg.get("timeout_s", 30.0)
)
job = strategy.setup(model, opt, nn.functional.mse_loss)
loader = loom.data.loader(least_squares(), 48, seed=1)

first = next(iter(loader))
evaluation = job.eval_step(first, {"mae": lambda out, target: (out - target).abs().mean()})


kill = [Fault("kill", cfg["kill_rank"], cfg["kill_step"] + 1, attempt=0)] if "kill_rank" in cfg else []
faults = Injector(topo.rank, kill, attempt)


def before_step(step: int) -> None:  # ``step`` counts from 0 here, from 1 for the injector
    faults.before_step(step + 1)
    time.sleep(cfg.get("slow_s", 0.0))


losses = train_steps(job, loader, cfg["steps"], before_step)
result = {
    "rank": topo.rank,
    "losses": losses,
    "eval": evaluation,
    "staleness": [r.staleness for r in job.metrics.records],
    "weight": job.state_dict()["model"]["weight"].flatten().tolist(),
    "attempt": attempt,
    "clock": job.step,
    "server_version": job.server_stats()[0]["models"]["default"]["version"],
}
Path(os.environ["LOOM_RUN_DIR"], f"result-{topo.rank}.json").write_text(json.dumps(result))
print(f"rank {topo.rank} finished {len(losses)} steps", flush=True)
