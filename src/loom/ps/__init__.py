"""Sharded parameter servers: authenticated wire format, shard plan, clocks, server process, worker client.

The strategy that uses them is `loom.parallel.ps.parameter_server.ParameterServer`; a server process is started
with ``python -m loom.ps.server --index i --num-servers K --bind HOST:PORT`` (``loom run --servers K`` does it).
"""

from loom.ps.client import PSClient
from loom.ps.clocks import MODES, ClockTable
from loom.ps.plan import ParamSpec, Piece, plan_shards, server_loads
from loom.ps.shard import ModelShard, ShardSettings
from loom.ps.wire import (
    DropCounters,
    Frame,
    FrameDropped,
    MessageType,
    SessionTable,
    WireLimits,
    decode,
    encode,
)

__all__ = [
    "MODES",
    "ClockTable",
    "DropCounters",
    "Frame",
    "FrameDropped",
    "MessageType",
    "ModelShard",
    "PSClient",
    "ParamSpec",
    "Piece",
    "SessionTable",
    "ShardSettings",
    "WireLimits",
    "decode",
    "encode",
    "plan_shards",
    "server_loads",
]
