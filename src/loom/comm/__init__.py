"""Collective communication written out: all-reduce by ring, central driver, shared memory, or the backend.

    from loom import comm
    comm.all_reduce(grad, op="avg")                     # algorithm="auto": picked per call, from measurements
    comm.all_reduce(grad, op="avg", algorithm="ring")
    comm.counters().snapshot()   # {"bytes_sent": ..., "bytes_received": ..., "ops": {"ring": 1}}
    comm.counters().by_transport()   # {"socket": {...}, "shm": {...}}

`all_reduce` is the entry point; `loom.comm.ring` and `loom.comm.driver` explain the two hand-written
message-passing algorithms, `loom.comm.shm` the shared-memory one for processes of one host,
`loom.comm.hierarchical` how the two combine across hosts and `loom.comm.auto` how one is chosen;
`loom.comm.shards` has `reduce_scatter` and `all_gather`, the two halves of an all-reduce that sharded training
uses apart; `loom.comm.counters` says how traffic is counted; `overlapped_allreduce_hook` plugs an algorithm into
DistributedDataParallel on a communication thread that overlaps backward (`allreduce_hook` runs it inline).
"""

from loom.comm._reduce import ALGORITHMS, OPS
from loom.comm.all_reduce import all_reduce
from loom.comm.counters import CommCounters, Traffic, counters
from loom.comm.ddp_async import allreduce_hook, overlapped_allreduce_hook
from loom.comm.shards import all_gather, piece_bounds, reduce_scatter

__all__ = [
    "ALGORITHMS",
    "OPS",
    "CommCounters",
    "Traffic",
    "all_gather",
    "all_reduce",
    "allreduce_hook",
    "counters",
    "overlapped_allreduce_hook",
    "piece_bounds",
    "reduce_scatter",
]
