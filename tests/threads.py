"""Ranks as threads: one process, one explicit gloo group per thread on a shared in-memory store.

The fast lane's harness (torchft's tests build their process groups the same way): no subprocess, no port, no
default process group, so a collective that takes an explicit ``group=`` can be checked at world sizes 2-4 in
milliseconds. Code that reaches for the implicit default group or the module-global topology
(`loom.topology.current()`) cannot run here; that is the point: it shows which code still does.

    results = run_ranks(3, lambda rank, group: comm.all_reduce(torch.ones(4) * rank, group=group))
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from loom.fault.quorum import gloo_group as quorum_gloo_group

T = TypeVar("T")


def gloo_group(store: dist.Store, rank: int, size: int, timeout_s: float = 20.0) -> dist.ProcessGroup:
    """A gloo process group of ``size`` ranks on ``store``, built directly (not registered with
    torch.distributed, so any number of them live in one process): ``rank``'s member. The healing job's own
    builder (`loom.fault.quorum.gloo_group`), with the tests' default timeout."""
    return quorum_gloo_group(store, rank, size, timeout_s)


def _build_groups(world_size: int, timeout_s: float) -> list[dist.ProcessGroup]:
    """One group per rank, built in threads. Gloo's full-mesh connect can fail on a busy host ("Connection closed
    by peer", seen once in 1,269 unit tests at 14 pytest workers on a 16-core machine, torch 2.11): such a
    build is retried, on a fresh store, up to three times; any other failure is the test's."""
    for attempt in range(3):
        store = dist.PrefixStore(f"run_ranks/{attempt}", dist.HashStore())
        groups: list[Any] = [None] * world_size
        errors: dict[int, BaseException] = {}

        def build(rank: int, store: dist.Store = store, groups: list = groups, errors: dict = errors) -> None:
            try:
                groups[rank] = gloo_group(store, rank, world_size, timeout_s)
            except BaseException as error:  # noqa: BLE001 - judged below
                errors[rank] = error

        threads = [threading.Thread(target=build, args=(r,), daemon=True) for r in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s + 10)
        if not errors and all(g is not None for g in groups):
            return groups
        if not any("connectFullMesh" in str(e) for e in errors.values()):
            first = min(errors) if errors else None
            raise AssertionError(
                f"building the gloo groups of {world_size} ranks failed: "
                + (f"rank {first}: {errors[first]}" if first is not None else "some ranks did not finish")
            ) from (errors[first] if first is not None else None)
    raise AssertionError(
        f"building the gloo groups of {world_size} ranks failed three times in connectFullMesh"
    )


def run_ranks(world_size: int, fn: Callable[[int, dist.ProcessGroup], T], timeout_s: float = 30.0) -> list[T]:
    """Run ``fn(rank, group)`` for ranks ``0..world_size-1``, each in its own thread with its own group; return
    the results in rank order.

    A rank that raises fails the call with its rank named (the first such rank's exception is chained). Groups
    time out after ``timeout_s``, so a rank waiting in a collective for a peer that died raises rather than
    hangs; a rank stuck elsewhere is reported after ``timeout_s`` (its thread is a daemon and is left behind)."""
    groups = _build_groups(world_size, timeout_s)
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, groups[rank])
        except BaseException as error:  # noqa: BLE001 - handed to the caller, named by rank
            errors[rank] = error

    threads = [
        threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(world_size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if errors:
        first = min(errors)
        raise AssertionError(
            f"rank {first} of {world_size} raised {type(errors[first]).__name__}: {errors[first]}"
            + (f" (ranks {sorted(errors)} failed)" if len(errors) > 1 else "")
        ) from errors[first]
    if stuck:
        raise AssertionError(f"ranks {stuck} of {world_size} did not finish within {timeout_s + 10:.0f} s")
    return results
