"""Ring all-reduce over loom's links in one situation, given as argv[1]; prints one JSON line per rank.

- ``nosecret``: no LOOM_JOB_SECRET (a job not started by `loom run`): the ring still reduces correctly, over
  gloo's point-to-point calls, with no socket of its own.
- ``other_secret``: rank 0 holds another secret: the whole ring goes through gloo (the two ranks that see a
  different secret warn); the reduction is still correct, every member cutting the same segments.
- ``peer_exits``: after one ring all-reduce, the last rank exits; the others' next ring all-reduce must fail
  at once with an error that names the rank that left (printed, with the seconds it took).

Run by tests/test_ring_links.py.
"""

import json
import os
import sys
import time
import warnings

import torch

mode = sys.argv[1]
if mode == "nosecret":
    os.environ.pop("LOOM_JOB_SECRET")
if mode == "other_secret" and os.environ["RANK"] == "0":
    os.environ["LOOM_JOB_SECRET"] = "ab" * 32

import loom  # noqa: E402 - after the environment is set
from loom import comm  # noqa: E402
from loom.comm.links import ring_link  # noqa: E402

topo = loom.init()
rank, n = topo.rank, topo.world_size
# 12 MiB: chunks of 4 MiB, cut in segments (more of them over links than over gloo: all must agree)
NUMEL = 3 << 19
data = torch.arange(NUMEL, dtype=torch.float64) * (rank + 1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = comm.all_reduce(data, "sum", "ring")
result: dict = {
    "correct": bool(torch.equal(out, torch.arange(NUMEL, dtype=torch.float64) * (n * (n + 1) // 2)))
}
link = ring_link(None, tuple(range(n)), rank, data)
result["linked"] = link is not None
result["rejected"] = link.rejected if link is not None else None
result["warnings"] = [str(w.message) for w in caught if "ring all-reduce goes through gloo" in str(w.message)]
if mode == "peer_exits":
    if rank == n - 1:
        print(json.dumps(result), flush=True)
        os._exit(0)
    started = time.monotonic()
    try:
        comm.all_reduce(data, "sum", "ring")
        result["error"] = None
    except RuntimeError as error:
        result["error"] = str(error)
    result["seconds"] = time.monotonic() - started
print(json.dumps(result), flush=True)
os._exit(0)  # the process group cannot be torn down cleanly with a member gone
