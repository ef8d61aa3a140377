"""Collective communication written out: all-reduce by ring, by a central driver, or by the backend.

    from loom import comm
    comm.all_reduce(grad, op="avg", algorithm="ring")
    comm.counters().snapshot()   # {"bytes_sent": ..., "bytes_received": ..., "ops": {"ring": 1}}

`all_reduce` is the entry point; `loom.comm.ring` and `loom.comm.driver` explain the two hand-written
algorithms, `loom.comm.counters` how traffic is counted, and `allreduce_hook` plugs an algorithm into
DistributedDataParallel.
"""

from loom.comm._reduce import ALGORITHMS, OPS
from loom.comm.all_reduce import all_reduce
from loom.comm.counters import CommCounters, counters
from loom.comm.ddp_hooks import allreduce_hook

__all__ = ["ALGORITHMS", "OPS", "CommCounters", "all_reduce", "allreduce_hook", "counters"]
