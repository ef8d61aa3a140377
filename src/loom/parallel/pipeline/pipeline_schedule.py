"""Pipeline schedules as data: one instruction stream per stage, executed by a separate runtime.

A schedule orders each of the ``p`` stages' forward (F) and backward (B) passes of the step's ``m`` micro-batches:

- **GPipe** (Huang et al. 2019): all ``m`` forwards, then all ``m`` backwards (in reverse); each stage keeps the
  activations of all ``m`` micro-batches alive until their backward.
- **1F1B** (PipeDream-Flush, Narayanan et al. 2021): stage ``s`` runs ``p - s - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains: GPipe's bubble, but at most ``p - s`` micro-batches alive.

With equal stage times both leave each stage idle a fraction ``(p - 1) / (m + p - 1)`` of the step
(`bubble_fraction`). Each compute op carries its communication (a forward receives its input and sends its
output, a backward the gradients; nothing past either end). `simulate` replays the streams with given op
durations (and reports a deadlock), so schedules are tested without processes. Schedules as generators of
instructions follow DeepSpeed's ``pipe/schedule.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "SCHEDULES",
    "Instruction",
    "Op",
    "SimulationResult",
    "bubble_fraction",
    "compute_order",
    "peak_live_microbatches",
    "simulate",
    "stage_instructions",
]

SCHEDULES = ("gpipe", "1f1b")


class Op(str, Enum):
    RECV_ACTIVATION = "recv_activation"
    FORWARD = "forward"
    SEND_ACTIVATION = "send_activation"
    RECV_GRADIENT = "recv_gradient"
    BACKWARD = "backward"
    SEND_GRADIENT = "send_gradient"


@dataclass(frozen=True)
class Instruction:
    op: Op
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.op.value}({self.microbatch})"


def _check(schedule: str, stage: int, stages: int, microbatches: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    if stages < 1 or microbatches < 1:
        raise ValueError(
            f"need stages >= 1 and microbatches >= 1, got stages={stages}, microbatches={microbatches}"
        )
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")


def compute_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of ``("F", j)`` and ``("B", j)`` compute ops of one stage."""
    _check(schedule, stage, stages, microbatches)
    m = microbatches
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
    warmup = min(stages - stage - 1, m)
    order = [("F", j) for j in range(warmup)]
    for k in range(m - warmup):  # steady state: one forward, one backward
        order += [("F", warmup + k), ("B", k)]
    order += [("B", j) for j in range(m - warmup, m)]  # cool-down: drain the backwards still owed
    return order


def stage_instructions(
    schedule: str, stage: int, stages: int, microbatches: int, *, forward_only: bool = False
) -> list[Instruction]:
    """The full instruction stream of ``stage``: compute ops with their receives and sends.

    ``forward_only`` gives the evaluation stream: every micro-batch's forward, no backward.
    """
    first, last = stage == 0, stage == stages - 1
    order = compute_order(schedule, stage, stages, microbatches)
    if forward_only:  # every schedule runs the forwards in micro-batch order
        order = [op for op in order if op[0] == "F"]
    out: list[Instruction] = []
    for kind, j in order:  # a receive from the neighbour before, a send to the one after (none past an end)
        if kind == "F":
            ops = [Op.RECV_ACTIVATION] * (not first) + [Op.FORWARD] + [Op.SEND_ACTIVATION] * (not last)
        else:
            ops = [Op.RECV_GRADIENT] * (not last) + [Op.BACKWARD] + [Op.SEND_GRADIENT] * (not first)
        out += [Instruction(op, j) for op in ops]
    return out


def peak_live_microbatches(instructions: list[Instruction]) -> int:
    """Most micro-batches whose activations are held at once (alive from their forward to their backward)."""
    live, peak = set(), 0
    for ins in instructions:
        if ins.op is Op.FORWARD:
            live.add(ins.microbatch)
            peak = max(peak, len(live))
        elif ins.op is Op.BACKWARD:
            live.discard(ins.microbatch)
    return peak


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle fraction ``(p - 1) / (m + p - 1)`` of a pipeline with equal stage times (GPipe paper, §2.3)."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclass(frozen=True)
class SimulationResult:
    makespan: float
    """Time from the first instruction to the last, over all stages."""
    busy: list[float]
    """Compute time of each stage."""

    @property
    def bubble(self) -> float:
        """Idle fraction of the whole pipeline: ``1 - sum(busy) / (p * makespan)``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def simulate(
    schedule: str,
    stages: int,
    microbatches: int,
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 1.0,
    message_time: float = 0.0,
) -> SimulationResult:
    """Replay every stage's instruction stream with fixed op durations and a fixed cost per message.

    ``forward_time`` and ``backward_time``: one duration for every stage, or one per stage (`loom.plan.cost`
    replays each stage's measured time). A receive waits for the matching op on the neighbouring stage plus
    ``message_time`` (one-way latency; 0: the textbook bubble); sends never block, as in the runtime. Messages on
    the critical path add to the makespan (two per step for GPipe with p = 2, about two per micro-batch for 1F1B,
    whose steady state leaves no slack). Raises `RuntimeError` if no stage can make progress (a deadlock).
    """
    if message_time < 0:
        raise ValueError(f"message_time must be >= 0, got {message_time}")
    forward, backward = _per_stage(forward_time, stages), _per_stage(backward_time, stages)
    streams = [stage_instructions(schedule, s, stages, microbatches) for s in range(stages)]
    pos = [0] * stages
    clock = [0.0] * stages
    busy = [0.0] * stages
    finish: dict[tuple[int, str, int], float] = {}
    while any(pos[s] < len(streams[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(streams[s]):
                ins = streams[s][pos[s]]
                sender = {Op.RECV_ACTIVATION: (s - 1, "F"), Op.RECV_GRADIENT: (s + 1, "B")}.get(ins.op)
                ready = clock[s] if sender is None else finish.get((*sender, ins.microbatch))
                if ready is None:
                    break
                if sender is not None:
                    ready += message_time
                clock[s] = max(clock[s], ready)
                if ins.op in (Op.FORWARD, Op.BACKWARD):
                    duration = forward[s] if ins.op is Op.FORWARD else backward[s]
                    clock[s] += duration
                    busy[s] += duration
                    finish[(s, "F" if ins.op is Op.FORWARD else "B", ins.microbatch)] = clock[s]
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: streams[s][pos[s]] for s in range(stages) if pos[s] < len(streams[s])}
            raise RuntimeError(f"schedule {schedule!r} deadlocks: stages wait at {stuck}")
    return SimulationResult(max(clock), busy)


def _per_stage(duration: float | Sequence[float], stages: int) -> list[float]:
    """One op duration per stage, from one for all or a sequence of ``stages``; durations must be >= 0."""
    values = (
        [float(duration)] * stages if isinstance(duration, (int, float)) else [float(d) for d in duration]
    )
    if len(values) != stages or any(not v >= 0 for v in values):
        raise ValueError(f"expected one duration >= 0 or {stages} of them (one per stage), got {duration!r}")
    return values
