"""After ``job.train_step`` returns, a parameter-server worker's ``job.module`` holds the parameters after that
step's update (issue 37, item 7): one run per mode, one worker, two servers; step 3's batch is non-finite and
skipped (``nonfinite="skip"``). One JSON line: the parameters after each step, and the servers' at the end
(`fetch_parameters`, read outside the consistency model).

Run by tests/test_ps_after_step.py.
"""

import json
import os
import sys

import torch
from common import least_squares
from torch import nn

import loom
from loom.parallel.ps.parameter_server import ParameterServer
from loom.topology import Topology

cfg = json.loads(sys.argv[1])
topo = Topology(0, 1, 0, 1, "none")  # one worker, no process group: the servers hold the model
data = least_squares()
torch.manual_seed(0)
model = nn.Linear(8, 1, bias=False)
strategy = ParameterServer(mode=cfg["mode"], addresses=tuple(os.environ["LOOM_PS_ADDRS"].split(",")),
                           namespace=f"after-{cfg['mode']}", topology=topo, nonfinite="skip")  # fmt: skip
job = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.functional.mse_loss)
after = [model.weight.detach().flatten().tolist()]
for step, (x, y) in enumerate(loom.data.loader(data, 16, seed=1, topology=topo), start=1):
    if step == 3:
        x = torch.full_like(x, float("nan"))
    job.train_step((x, y))
    after.append(job.module.weight.detach().flatten().tolist())
    if step == 5:
        break
skipped = job.last_step_skipped
mine = job.module.weight.detach().clone()
server = job.fetch_parameters().weight.detach().clone()
print(json.dumps({"after": after, "server": server.flatten().tolist(), "mine": mine.flatten().tolist(),
                  "traffic": job.client.traffic}), flush=True)  # fmt: skip
job.close()
