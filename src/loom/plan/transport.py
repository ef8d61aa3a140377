"""The transport as the plan sees it: seconds per collective and message size, measured by loom's own code.

Measured (`measure_transport`, run inside a ``loom run -n N`` job of `loom.plan.trial`): every all-reduce
algorithm `loom.comm.auto` would choose between on this topology (``loom.comm.all_reduce(..., algorithm=a)``:
the very calls `DataParallel` makes), `loom.comm.reduce_scatter` and `loom.comm.all_gather` (the halves sharded
training uses) and a point-to-point exchange (``isend``/``recv`` both ways between rank pairs: a pipeline's
activations and gradients). As `loom.comm.auto` calibrates, each call starts after a barrier, each entry is the
slowest rank's time (an all-reduce MAX), and the median of the repetitions is kept. The sizes are the ones the
plan needs (the model's gradient, parameter and activation bytes), plus a few small ones for the latency.

`Transport.seconds` interpolates linearly between measured sizes and refuses a size above the largest measured
(`OutsideCalibration`): no extrapolation. A size below the smallest costs the smallest's time (latency-bound).

Several hosts (``--hosts H --link RATE``): the measured local time is a floor, and the link adds the
bandwidth-bound time of a ring over it (Patarasuk & Yuan 2009): an all-reduce of D bytes moves
``2 (N - 1) / N * D`` over each link, an all-gather or reduce-scatter ``(N - 1) / N * D``, a point-to-point
message ``D``; the time is the larger of the two. This is a model, not a measurement, until the namespace-host
scenarios are measured (`docs/plan.md`).
"""

from __future__ import annotations

import bisect
import functools
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from loom.plan.profile import OutsideCalibration

__all__ = ["Transport", "link_bound_seconds", "measure_transport", "parse_rate"]

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(text: str) -> float:
    """A link rate in ``tc``'s words (``100mbit``, ``1gbit``, ``2.5gbit``) as bytes per second."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
    if match is None or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"unknown link rate {text!r}. HINT: a positive number and a unit of bits per second, as tc writes it: "
            f"{', '.join(f'1{u}' for u in _UNITS if u != 'bit')} (e.g. --link 100mbit)"
        )
    return float(match.group(1)) * _UNITS[match.group(2)] / 8.0


def link_bound_seconds(op: str, nbytes: float, world_size: int, rate_bytes_per_s: float) -> float:
    """Bandwidth-bound time of ``op`` on a link of ``rate_bytes_per_s`` (module docstring): a ring all-reduce
    moves ``2 (N-1)/N x D`` bytes over each link, all-gather and reduce-scatter half that, point-to-point ``D``."""
    n = world_size
    share = {"p2p": 1.0, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(op, 2 * (n - 1) / n)
    return share * nbytes / rate_bytes_per_s


@dataclass(frozen=True)
class Transport:
    """Measured seconds per operation (``allreduce:<algorithm>``, ``all_gather``, ``reduce_scatter``, ``p2p``) at
    each of ``sizes`` bytes on ``world_size`` processes of one host; optionally several hosts on a given link."""

    world_size: int
    sizes: tuple[int, ...]
    seconds: dict[str, tuple[float, ...]]
    overlap: float = 0.0
    """The measured fraction of the shorter of backward and DDP's all-reduce hidden by the other (see
    `loom.plan.trial`); negative when running both at once is slower than one after the other."""
    hosts: int = 1
    link_bytes_per_s: float | None = None
    measured: dict[str, str] = field(default_factory=dict)

    @property
    def algorithms(self) -> tuple[str, ...]:
        return tuple(k.split(":", 1)[1] for k in self.seconds if k.startswith("allreduce:"))

    def time(self, op: str, nbytes: float) -> float:
        """Seconds of one ``op`` on ``nbytes`` (interpolated; refused above the largest measured size)."""
        if op not in self.seconds:
            raise OutsideCalibration(f"{op} was not measured (measured: {', '.join(self.seconds)})")
        if nbytes <= 0:
            return 0.0
        table = self.seconds[op]
        if nbytes > self.sizes[-1]:
            raise OutsideCalibration(
                f"{op} of {int(nbytes)} bytes is above the largest measured size {self.sizes[-1]}"
            )
        i = bisect.bisect_left(self.sizes, nbytes)
        if i == 0:
            local = table[0]
        else:
            lo, hi = self.sizes[i - 1], self.sizes[i]
            local = table[i - 1] + (table[i] - table[i - 1]) * (nbytes - lo) / (hi - lo)
        if self.hosts > 1 and self.link_bytes_per_s:
            return max(
                local, link_bound_seconds(op.split(":")[0], nbytes, self.world_size, self.link_bytes_per_s)
            )
        return local

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "sizes": list(self.sizes), "seconds": self.seconds,
                "overlap": self.overlap, "hosts": self.hosts, "link_bytes_per_s": self.link_bytes_per_s}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> Transport:
        return cls(
            int(data["world_size"]), tuple(int(s) for s in data["sizes"]),
            {k: tuple(float(x) for x in v) for k, v in data["seconds"].items()}, float(data.get("overlap", 0.0)),
        )  # fmt: skip


def _timed(fn: Callable[[], object], reps: int, group: Any) -> torch.Tensor:
    fn()  # warm-up, and set-up (shared memory, links)
    out = torch.zeros(reps, dtype=torch.float64)
    for rep in range(reps):
        dist.barrier(group=group)  # start together: a late rank would be charged to the others
        started = time.perf_counter()
        fn()
        out[rep] = time.perf_counter() - started
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)  # each call lasts as long as its slowest rank
    return out


def _p2p(data: torch.Tensor, rank: int, world: int, group: Any) -> None:
    """Each even rank exchanges one message each way with the odd rank after it (a pipeline boundary)."""
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= world:
        return
    recv = torch.empty_like(data)
    if rank % 2 == 0:
        dist.send(data, peer, group=group)
        dist.recv(recv, peer, group=group)
    else:
        dist.recv(recv, peer, group=group)
        dist.send(data, peer, group=group)


def _operations(
    size: int, algorithms: tuple[str, ...], rank: int, world: int, group: Any
) -> dict[str, Callable[[], object]]:
    """Each timed operation on a float32 message of ``size`` bytes."""
    from loom.comm import all_gather, all_reduce, piece_bounds, reduce_scatter

    data = torch.zeros(size // 4, dtype=torch.float32)
    lo, hi = piece_bounds(data.numel(), rank, world)
    ops: dict[str, Callable[[], object]] = {}
    for a in algorithms:
        ops[f"allreduce:{a}"] = functools.partial(all_reduce, data, "sum", algorithm=a, group=group)
    ops["reduce_scatter"] = lambda: reduce_scatter(data, "sum", group=group)
    ops["all_gather"] = lambda: all_gather(data[lo:hi].clone(), data.numel(), group=group)
    ops["p2p"] = lambda: _p2p(data, rank, world, group)
    return ops


def measure_transport(sizes: list[int], reps: int = 5) -> Transport:
    """Time every operation at every size on the job's group (a collective: every rank calls it)."""
    from loom.comm.auto import candidates
    from loom.comm.shm import context_for
    from loom.topology import current

    group = current().group
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = sorted({max(4, (int(s) // 4) * 4) for s in sizes})
    algorithms = candidates(context_for(group))
    seconds: dict[str, list[float]] = {f"allreduce:{a}": [] for a in algorithms}
    seconds.update({"reduce_scatter": [], "all_gather": [], "p2p": []})
    for size in sizes:
        for name, fn in _operations(size, algorithms, rank, world, group).items():
            seconds[name].append(statistics.median(_timed(fn, reps, group).tolist()))
    return Transport(world, tuple(sizes), {k: tuple(v) for k, v in seconds.items()})
