"""One shm all-reduce, this job's segment name written to DIR/<rank>.name, then rank 0 (the segment's
creator) kills itself with SIGKILL while the others keep reducing. Usage: comm_shm_lifecycle.py DIR.

Run by tests/test_comm_shm.py.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import loom
from loom import comm
from loom.comm import shm

topo = loom.init()
out = Path(sys.argv[1])
data = torch.full((1000,), float(topo.rank))
comm.all_reduce(data, "sum", "shm")
name = shm.context_for(None).segment.name
(out / f"{topo.rank}.name").write_text(name)
dist.barrier()  # every name is written
if topo.rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
for _ in range(100_000):  # the survivors' barrier notices the dead peer, unless the harness is faster
    comm.all_reduce(data, "sum", "shm")
