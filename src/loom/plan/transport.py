"""The transport as the plan sees it: seconds per collective and message size on this host, and the link between
hosts.

`Transport` holds what `loom.plan.transport_timing.measure_transport` measured (`envelope`: each size capped by
a larger size's time) and the calibration's fixed costs; `Transport.time` never extrapolates. Several hosts
(``--hosts H --link RATE``): the measured local time is a floor, and the link adds the bandwidth-bound time of a
ring over it (`link_bound_seconds`, Patarasuk & Yuan 2009); the time is the larger.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from dataclasses import dataclass, field

from loom.plan.profile import OutsideCalibration

__all__ = ["Transport", "envelope", "link_bound_seconds", "parse_rate"]

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
    """Bandwidth-bound time of ``op`` on ``nbytes`` over a link of ``rate_bytes_per_s``: a ring all-reduce moves
    ``2 (N-1)/N x D`` bytes over each link (a reduce-scatter too), an all-gather half that, point-to-point ``D``."""
    n = world_size
    # A parameter server's frames: their link time depends on how many share the server's link, which the cost
    # model charges (`loom.plan.cost`), not one frame.
    # gloo has no reduce-scatter of its own: an all-reduce underneath, whose bytes it moves.
    shares = {"p2p": 1.0, "all_gather": (n - 1) / n, "ps_encode": 0.0, "ps_decode": 0.0}
    return shares.get(op, 2 * (n - 1) / n) * nbytes / rate_bytes_per_s


@dataclass(frozen=True)
class Transport:
    """Measured seconds per operation (``allreduce:<algorithm>``, ``all_gather``, ``reduce_scatter``, ``p2p``) at
    each of ``sizes`` bytes on ``world_size`` processes of one host; optionally several hosts on a given link."""

    world_size: int
    sizes: tuple[int, ...]
    seconds: dict[str, tuple[float, ...]]
    overlap: float = 0.0
    """``k`` (docs/plan.md#cost-model): the measured fraction of the shorter of backward and DDP's all-reduce
    hidden by the other (`loom.plan.planner._with_overlap`); negative when running both at once is slower."""
    hosts: int = 1
    link_bytes_per_s: float | None = None
    fsdp_unit_s: dict[str, float] = field(default_factory=dict)
    """loom's FSDP fixed cost per unit beyond its collectives, by ZeRO stage (``stage2``, ``stage3``), measured
    by `loom.plan.trial`'s calibration."""
    ps_fixed_s: float | None = None
    """A synchronous parameter server's fixed cost per step beyond its frames (round trips, the server's own
    handling), measured by the calibration; None when it ran without a server (parameter servers refused)."""
    ps_save_bytes_per_s: float | None = None
    """How fast this host writes a synchronous parameter server's checkpoint, which each server writes after every
    step by default, before its replies (`ParameterServer(checkpoint_every=)`); None: not measured."""
    ddp_extra_s: float = 0.0
    """What DDP's native all-reduce exposed in the reference's step beyond ``overlap = -1`` (DDP's own work, the
    wake-ups of gloo's thread): charged to ``DataParallel(allreduce="native")`` alone, which it was measured on."""

    @property
    def algorithms(self) -> tuple[str, ...]:
        return tuple(k.split(":", 1)[1] for k in self.seconds if k.startswith("allreduce:"))

    def time(self, op: str, nbytes: float) -> float:
        """Seconds of one ``op`` on ``nbytes``: interpolated linearly between measured sizes, the smallest's time
        below them (latency-bound); refused above the largest measured (`OutsideCalibration`)."""
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
        if math.isinf(table[i]):
            raise OutsideCalibration(
                f"{op} was measured up to {self.finite_up_to(op)} bytes, not {int(nbytes)}"
            )
        if i == 0:
            local = table[0]
        else:
            lo, hi = self.sizes[i - 1], self.sizes[i]
            local = table[i - 1] + (table[i] - table[i - 1]) * (nbytes - lo) / (hi - lo)
        if self.hosts > 1 and self.link_bytes_per_s:
            link = link_bound_seconds(op.split(":")[0], nbytes, self.world_size, self.link_bytes_per_s)
            return max(local, link)
        return local

    def finite_up_to(self, op: str) -> int:
        """The largest size ``op`` was measured at (0: none)."""
        measured = (s for s, t in zip(self.sizes, self.seconds[op], strict=True) if not math.isinf(t))
        return max(measured, default=0)

    def to_json(self) -> dict:
        """Every field as plain JSON (an unmeasured size, above its limit, is ``null``, not ``Infinity``)."""
        seconds = {k: [None if math.isinf(x) else x for x in v] for k, v in self.seconds.items()}
        return {**dataclasses.asdict(self), "sizes": list(self.sizes), "seconds": seconds}

    @classmethod
    def from_json(cls, data: dict) -> Transport:
        return cls(
            int(data["world_size"]), tuple(int(s) for s in data["sizes"]),
            {k: tuple(math.inf if x is None else float(x) for x in v) for k, v in data["seconds"].items()},
            float(data.get("overlap", 0.0)),
            ddp_extra_s=float(data.get("ddp_extra_s", 0.0)),
            fsdp_unit_s={k: float(v) for k, v in data.get("fsdp_unit_s", {}).items()},
            ps_fixed_s=None if data.get("ps_fixed_s") is None else float(data["ps_fixed_s"]),
            ps_save_bytes_per_s=None if not data.get("ps_save_bytes_per_s") else float(data["ps_save_bytes_per_s"]),
        )  # fmt: skip


def envelope(seconds: list[float]) -> tuple[float, ...]:
    """Each size's time, or a larger size's where that was measured faster: a message can always be sent padded
    to a larger size, so that size's time bounds it, and what disturbs a measurement here (another process
    scheduled, a late wake-up) only ever adds time. Unmeasured sizes (``inf``, above a limit) stay unmeasured."""
    out, best = list(seconds), math.inf
    for i in range(len(out) - 1, -1, -1):
        if math.isfinite(out[i]):
            best = min(best, out[i])
            out[i] = best
    return tuple(out)
