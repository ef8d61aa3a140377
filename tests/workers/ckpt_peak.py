"""Rank 0's peak memory while a 4-stage Pipeline saves a checkpoint: ``ckpt_peak.py DIR WIDTH [async]``.

Each stage holds two Linear(WIDTH, WIDTH) trained one step with Adam (parameters, gradients and two moments:
4 * 2 * WIDTH**2 * 4 bytes of training state per stage). After that step every rank resets its high-water mark
(``/proc/self/clear_refs``), saves one checkpoint through `FitCheckpointer` (the path `loom.fit` takes), and
prints one JSON line: its own state's bytes, its resident memory before the save and its peak during it. Then
every rank loads the checkpoint back (`resume_fit`) into its job and reports whether its part came back bitwise.
Run by tests/test_checkpoint_shards.py (at WIDTH 1024) and by hand for docs/checkpoints.md's figures.
"""

import hashlib
import json
import re
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import loom
from loom.checkpoint import pack_state
from loom.train.fit_checkpoint import FitCheckpointer

try:
    from loom.train.fit_resume import resume_fit
except ImportError:  # loom before per-rank checkpoint files (main at 48d3567), for the "before" figures
    from loom.train.fit_checkpoint import resume_fit  # type: ignore[attr-defined,no-redef]

directory, width = Path(sys.argv[1]), int(sys.argv[2])
use_async = len(sys.argv) > 3 and sys.argv[3] == "async"
topo = loom.init()
torch.manual_seed(0)
model = nn.Sequential(*(nn.Linear(width, width) for _ in range(8)))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
job = loom.Pipeline(stages=4, microbatches=2).setup(model, optimizer, nn.functional.mse_loss)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(8, width, generator=g), torch.randn(8, width, generator=g))
loader = job.loader(data, 4, seed=0)
loom.fit(job, loader, steps=1, progress=False)


def status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def digest() -> str:
    state = job.state_dict()
    return hashlib.sha256(pack_state({"model": state["model"], "optimizer": state["optimizer"]})).hexdigest()


params = [p for p in job.module.parameters()]
own_bytes = (
    sum(p.numel() * p.element_size() for p in params) * 4
)  # parameters, gradients, exp_avg, exp_avg_sq
before_sha = digest()
checkpointer = FitCheckpointer(job, loader, None, directory, keep=2, use_async=use_async)
Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from the current RSS
rss_before = status("VmRSS")
checkpointer.save(1, {"step": 1, "epoch": 0, "batch_in_epoch": 1})
checkpointer.finish()
peak = status("VmHWM")
for p in params:  # change the state, so that loading it back is seen
    p.data.add_(1.0)
resumed = resume_fit(job, loader, None, directory, topo)
record = {
    "rank": topo.rank,
    "own_state_bytes": own_bytes,
    "rss_before": rss_before,
    "peak": peak,
    "grown": peak - rss_before,
    "resumed_step": None if resumed is None else resumed[0],
    "bitwise": digest() == before_sha,
}
print(json.dumps(record), flush=True)
