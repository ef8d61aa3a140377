"""LocalSGD and DiLoCo under loom.fit with checkpoints: ``local_sgd_fit.py NAME=DIR:STEPS ...``.

Run by tests/test_local_sgd.py and tests/test_diloco.py (20 steps straight against 10, then a resume to 20 in
new processes). NAME picks the strategy (`STRATEGIES`); each run builds fresh objects as a restarted script
would and resumes from DIR when it holds a checkpoint. The model has dropout and each rank seeds its RNG
differently, so a resume must restore every rank's own RNG state. Prints one JSON line per rank and run: the
result, the exchanges in flight at the end, and a SHA-256 of this rank's whole job state (bitwise comparison).
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from common import make_dataset
from torch import nn

import loom
from loom.checkpoint import pack_state

topo = loom.init()

STRATEGIES = {
    # checkpoints every 5 steps: 10 is mid-interval for every one of these
    "local": lambda: loom.LocalSGD(sync_every=4, allreduce="native"),
    "diloco": lambda: loom.DiLoCo(sync_every=3, compression="int8"),
    # fragment 1 is sent after step 10 and applied after step 11: in flight at the checkpoint of step 10;
    # loom's ring all-reduce on the communication thread while the training thread reduces its loss
    "streaming": lambda: loom.DiLoCo(sync_every=4, fragments=2, compression="fp16", allreduce="ring"),
}

for run in sys.argv[1:]:
    name, spec = run.split("=", 1)
    checkpoint_dir, steps = spec.rsplit(":", 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    job = STRATEGIES[name]().setup(model, optimizer, nn.functional.mse_loss)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    torch.manual_seed(100 + topo.rank)
    loader = job.loader(make_dataset(), 10, seed=1)
    result = loom.fit(
        job, loader, steps=int(steps), checkpoint_dir=checkpoint_dir, checkpoint_every=5, keep=2,
        lr_scheduler=scheduler, progress=False,
    )  # fmt: skip
    state = job.state_dict()
    record = {
        "rank": topo.rank,
        "run": f"{name}={Path(checkpoint_dir).name}:{steps}",
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        "loss": result.last_loss,
        "in_flight": len(state.get("in_flight", [])),
        "state_sha": hashlib.sha256(pack_state(state)).hexdigest(),
    }
    print(json.dumps(record), flush=True)
