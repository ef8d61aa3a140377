"""Sharded parameter servers: authenticated wire format, shard plan, clocks, server process, worker client.

The strategy that uses them is `loom.parallel.ps.parameter_server.ParameterServer`; a server process is started
with ``python -m loom.ps.server --index i --num-servers K --bind HOST:PORT`` (``loom run --servers K`` does it).
"""
