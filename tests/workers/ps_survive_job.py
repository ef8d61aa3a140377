"""A parameter-server job whose server 0 is SIGKILLed mid-training, for tests/test_ps_survive.py (`loom run`).

The argument is JSON: mode, steps, slow_s (sleep per step), kill_steps (before each of these steps rank 0 kills
server 0: the pid is the launcher's record, ``$LOOM_RUN_DIR/ps-servers.json``), staleness, in_flight (sync: the kill lands
0.4 s into the step, while rank 0's push waits for rank 1, which sleeps 1 s first: the step in flight is lost with
the server and repeated), checkpoint_interval_s (optional). Each worker writes ``$LOOM_RUN_DIR/result-<rank>.json``
with its final weight, its losses, the restarts it found, and (rank 0) the kill times.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from common import least_squares, train_steps
from torch import nn

import loom

cfg = json.loads(sys.argv[1])
run_dir = Path(os.environ["LOOM_RUN_DIR"])
topo = loom.init()
torch.manual_seed(0)
model = nn.Linear(8, 1, bias=False)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
options = {"mode": cfg["mode"], "worker_timeout_s": 30.0}
for key in ("checkpoint_interval_s", "staleness"):
    if key in cfg:
        options[key] = cfg[key]
job = loom.ParameterServer(**options).setup(model, opt, nn.functional.mse_loss)
loader = loom.data.loader(least_squares(), 48, seed=1)
kills: list[float] = []


def kill_server() -> None:
    record = json.loads((run_dir / "ps-servers.json").read_text())
    kills.append(time.time())
    os.kill(record["servers"][0]["pid"], signal.SIGKILL)


def before_step(step: int) -> None:
    if step in cfg.get("kill_steps", []):
        if cfg.get("in_flight"):
            if topo.rank == 0:
                threading.Timer(0.4, kill_server).start()
            else:
                time.sleep(1.0)
        elif topo.rank == 0:
            kill_server()
    time.sleep(cfg.get("slow_s", 0.0))


losses = train_steps(job, loader, cfg["steps"], before_step)
result = {
    "rank": topo.rank,
    "losses": losses,
    "weight": job.state_dict()["model"]["weight"].flatten().tolist(),
    "restarts": job.metrics.server_restarts,
    "kills": kills,
    "clock": job.step,
}
(run_dir / f"result-{topo.rank}.json").write_text(json.dumps(result))
print(f"rank {topo.rank} finished {len(losses)} steps", flush=True)
