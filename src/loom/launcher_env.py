"""The launcher's environment, read and checked, and a bounded wait for the peers it names.

`loom.init()` reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; each is checked
here with an error naming it, its value and the fix, instead of a raw error deep inside torch. A job started
without an agent (plain ``python train.py`` with the variables set) meets its peers in a store whose join is
bounded by ``LOOM_JOIN_TIMEOUT_S`` (`join_env_store`), not torch's silent 30 minutes; under ``loom run`` and
``torchrun`` the launcher bounds the join. Before and after: docs/fault-tolerance.md ("The launcher's environment").
"""

from __future__ import annotations

import datetime
import os
import sys
import time

from loom.settings import setting

__all__ = ["read_launcher_env", "join_env_store"]

NOTICE_AFTER_S = 10.0
"""Seconds a rank waits for its peers before it says whom it waits for."""
_POLL_S = 0.2


def _int_var(name: str, default: int, minimum: int, fix: str) -> int:
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer. HINT: {fix}") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={value} is below {minimum}. HINT: {fix}")
    return value


def read_launcher_env() -> tuple[int, int, int, int]:
    """``(world_size, rank, local_rank, local_world_size)`` from the environment, each checked; for a job of
    several processes, MASTER_ADDR and MASTER_PORT too. `ValueError` names the variable, its value and the fix."""
    fix = "launch with `loom run -n N` (or torchrun), or unset WORLD_SIZE and RANK to run one process"
    world_size = _int_var("WORLD_SIZE", 1, 1, fix)
    rank = _int_var("RANK", 0, 0, fix)
    if rank >= world_size:
        raise ValueError(f"environment variable RANK={rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size}). "
                         f"HINT: {fix}")  # fmt: skip
    local_rank = _int_var("LOCAL_RANK", 0, 0, fix)
    local_world_size = _int_var("LOCAL_WORLD_SIZE", world_size, 1, fix)
    if world_size > 1:
        if not os.environ.get("MASTER_ADDR", "").strip():
            raise ValueError(f"WORLD_SIZE={world_size} but MASTER_ADDR is not set. HINT: {fix}")
        port = _int_var("MASTER_PORT", 0, 1, "set MASTER_PORT to rank 0's port, an integer in 1..65535")
        if not 1 <= port <= 65535:
            raise ValueError(f"environment variable MASTER_PORT={port} is not a port. HINT: set MASTER_PORT to rank "
                             "0's port, an integer in 1..65535")  # fmt: skip
    return world_size, rank, local_rank, local_world_size


def join_env_store(rank: int, world_size: int, timeout_s: float):
    """A TCP store at MASTER_ADDR:MASTER_PORT (hosted by rank 0, as torch's ``env://`` does) once every rank has
    joined it, its timeout then set to ``timeout_s`` for the process group. Raises `RuntimeError` naming the
    missing ranks when they have not all joined within ``LOOM_JOIN_TIMEOUT_S``."""
    from torch.distributed import TCPStore

    addr, port = os.environ["MASTER_ADDR"].strip(), int(os.environ["MASTER_PORT"])
    limit = setting("LOOM_JOIN_TIMEOUT_S")
    where = f"MASTER_ADDR:MASTER_PORT {addr}:{port}"
    try:
        store = TCPStore(addr, port, world_size, is_master=rank == 0, multi_tenant=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=limit))  # fmt: skip
    except (RuntimeError, OSError) as error:
        first = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
        role = "could not listen on" if rank == 0 else "could not reach rank 0 at"
        raise RuntimeError(f"rank {rank} of WORLD_SIZE={world_size} {role} {where} within {limit:g} s "
                           f"(LOOM_JOIN_TIMEOUT_S): {first}. HINT: start rank 0 first, with the same "
                           "MASTER_ADDR and MASTER_PORT, or launch with `loom run -n N`") from None  # fmt: skip
    keys = [f"loom/joined/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    started = time.monotonic()
    noticed = False
    while True:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            break
        waited = time.monotonic() - started
        if waited >= limit:
            raise RuntimeError(f"rank {rank}: rank(s) {missing} of WORLD_SIZE={world_size} did not join at {where} "
                               f"within {limit:g} s (LOOM_JOIN_TIMEOUT_S). HINT: start every rank, e.g. with "
                               "`loom run -n N`, or unset WORLD_SIZE and RANK to run one process")  # fmt: skip
        if not noticed and waited >= NOTICE_AFTER_S:
            print(f"loom: rank {rank}: waiting for rank(s) {missing} of WORLD_SIZE={world_size} to join at {where}; "
                  f"giving up after {limit:g} s (LOOM_JOIN_TIMEOUT_S)", file=sys.stderr, flush=True)  # fmt: skip
            noticed = True
        time.sleep(_POLL_S)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store
