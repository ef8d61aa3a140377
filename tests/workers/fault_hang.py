"""One rank skips an all-reduce: the others must be stopped by loom's watchdog with a report naming it.

``fault_hang.py TIMEOUT_S STAMP_FILE``, with a ``skip`` fault in LOOM_TEST_FAULTS (tests/workers/faults.py), e.g.
``skip@1:3``: a few DataParallel steps, each followed by a user-level metric all-reduce counted by the watchdog;
at the fault's step (3) its rank skips that all-reduce and goes on into the
next step's gradient all-reduce: every rank is inside a collective and they never meet (a rank merely busy
outside collectives is not a hang, see tests/test_uneven_work.py). Rank 0 writes the time it entered the doomed
all-reduce to STAMP_FILE.

Run by tests/test_fault.py.
"""

import sys
import time

import torch
import torch.distributed as dist
from common import make_dataset, make_mlp
from faults import Injector
from torch import nn

import loom
from loom.fault import watchdog

timeout_s, stamp = float(sys.argv[1]), sys.argv[2]
topo = loom.init()
model = make_mlp()
# overlap=False: gradients averaged in shared memory on any host, so the collectives are numbered alike everywhere
job = loom.DataParallel(hang_timeout_s=timeout_s, overlap=False).setup(
    model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss
)
faults = Injector.from_env(topo.rank)
for step, batch in enumerate(loom.data.loader(make_dataset(), 9, seed=0), start=1):
    metric = torch.tensor([job.train_step(batch)])
    if faults.skips(step):
        print(f"rank {topo.rank} skips the metric all-reduce of step {step}", flush=True)
        continue  # on into step 4's gradient all-reduce, which the others never enter
    if step == 3 and topo.rank == 0:
        with open(stamp, "w") as f:
            f.write(str(time.time()))
    with watchdog.collective("metric all-reduce"):
        dist.all_reduce(metric)
print(f"rank {topo.rank} finished: the hang went unnoticed", flush=True)
