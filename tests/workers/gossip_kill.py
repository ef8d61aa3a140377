"""A gossip job under `loom run -n 3 --on-worker-failure continue` in which one worker SIGKILLs itself.

The argument is JSON: steps, kill_rank, kill_step, slow_s (sleep per batch, so the kill lands mid-training) and
deadline_s. Every worker trains through `loom.fit` (no checkpoint: fit's loop itself takes no collective) from
the same start; the survivors must skip the dead peer and finish every step, then wait (serving) until every
survivor has finished. Each writes
``$LOOM_RUN_DIR/gossip-<rank>.json`` with its steps, training time, losses and `comm_stats()`.
Run by tests/test_gossip.py.
"""

import json
import os
import sys
import time
from pathlib import Path

from faults import Fault, Injector
from gossip_common import build, dataset
from torch import nn

import loom
from loom.parallel.gossip.gossip import Gossip

cfg = json.loads(sys.argv[1])
topo = loom.init()
faults = Injector(topo.rank, [Fault("kill", cfg["kill_rank"], cfg["kill_step"] + 1)])
model, opt = build(0, lr=0.05)
job = Gossip(peers="ring", deadline_s=cfg["deadline_s"]).setup(model, opt, nn.functional.mse_loss)
loader = job.loader(dataset(), global_batch_size=12, seed=3)


class Paced:
    """The loader, slowed down, with the kill before batch ``kill_step`` on ``kill_rank``."""

    def __init__(self, inner):
        self.inner, self.taken = inner, 0

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def __iter__(self):
        for batch in self.inner:
            faults.before_step(self.taken + 1)
            time.sleep(cfg["slow_s"])
            self.taken += 1
            yield batch


started = time.monotonic()
result = loom.fit(job, Paced(loader), steps=cfg["steps"], progress=False)
elapsed = time.monotonic() - started
# Each survivor keeps serving (it has not closed) until every survivor has finished: the other's exchanges with
# it are then answered whatever the speeds, which makes the test's counts follow from the schedule alone.
run_dir = Path(os.environ["LOOM_RUN_DIR"])
(run_dir / f"finished-{topo.rank}").touch()
survivors = [r for r in range(topo.world_size) if r != cfg["kill_rank"]]
until = time.monotonic() + 120
while not all((run_dir / f"finished-{r}").exists() for r in survivors) and time.monotonic() < until:
    time.sleep(0.05)
stats = job.comm_stats()
job.close()
record = {"rank": topo.rank, "steps": result.steps, "elapsed": elapsed, "stats": stats,
          "losses": [r.loss for r in job.metrics.records]}  # fmt: skip
Path(os.environ["LOOM_RUN_DIR"], f"gossip-{topo.rank}.json").write_text(json.dumps(record))
print(f"rank {topo.rank} finished {result.steps} steps", flush=True)
