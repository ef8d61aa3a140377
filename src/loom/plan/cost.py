"""The cost model: a configuration's step time, memory per process and bytes on the wire, from measurements.

One formula per family (`_FORMULAS`) over the model's profile (`loom.plan.profile`) and the transport's measured
times (`loom.plan.transport`); the formulas, their notation (``C(b)``, ``O``, ``k``, ``R_z``, ``E``) and where
loom's memory differs from the textbook are in docs/plan.md#cost-model. Nothing is extrapolated: a formula that
needs a measurement the plan did not make raises `OutsideCalibration`, and the configuration is refused with that
reason. Pipelines are the replay of loom's own instruction streams (`pipeline_schedule.simulate`), so the bubble
follows from the schedule (``(p - 1) / (m + p - 1)`` with equal stages and free messages, GPipe paper §2.3).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from loom.parallel.pipeline.pipeline_schedule import peak_live_microbatches, simulate, stage_instructions
from loom.parallel.pipeline.pipeline_split import balanced_cuts, stage_ranges
from loom.plan.codecs import CodecCost
from loom.plan.configs import Configuration
from loom.plan.profile import ModelProfile, OutsideCalibration
from loom.plan.transport import Transport
from loom.ps.wire import WireLimits

__all__ = ["Prediction", "predict"]


@dataclass(frozen=True)
class Prediction:
    config: Configuration
    step_time_s: float = math.inf
    samples_per_s: float = 0.0
    memory: dict[str, int] = field(default_factory=dict)
    """Bytes per process (the largest process) by category: parameters, gradients, optimizer, activations,
    other, transient, runtime, and their total (the predicted peak RSS)."""
    wire_bytes: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    """Communication on the step's critical path (after overlap)."""
    bubble: float = 0.0
    refused: str = ""
    """Why this configuration was not predicted (not modelled, not applicable, outside the measured range)."""


def _memory(
    params: float, grads: float, optimizer: float, activations: float, other: float = 0
) -> dict[str, int]:
    parts = {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": activations,
             "other": other}  # fmt: skip
    out = {k: int(v) for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


def _ring(n: int, nbytes: float) -> int:
    return int(2 * (n - 1) / n * nbytes)


class _Model:
    """The pieces every formula shares, for one configuration."""

    def __init__(self, config: Configuration, profile: ModelProfile, transport: Transport, global_batch: int,
                 codecs: dict[str, CodecCost], spare_core: bool, overhead: float, fsdp_extra: int):  # fmt: skip
        self.c, self.p, self.t = config, profile, transport
        self.codecs, self.spare_core, self.fsdp_extra = codecs, spare_core, fsdp_extra
        self.n = config.nproc
        self.global_batch = global_batch
        self.share = math.ceil(global_batch / config.dp)
        self.small = transport.time("allreduce:native", 8)
        self.overhead = overhead

    def exposed(self, comm: float, backward: float) -> float:
        k = min(1.0, self.t.overlap)
        return comm - k * min(comm, backward)

    def best_allreduce(self, nbytes: float) -> float:
        return min(self.t.time(f"allreduce:{a}", nbytes) for a in self.t.algorithms)

    def plus_overhead(self, step: float) -> float:
        """``step`` plus the engine overhead; a negative overhead (the calibration's noise) takes at most half of
        ``step``, as it does of the calibration's own, so a smaller configuration's step stays positive."""
        return step + max(self.overhead, -step / 2)

    def done(self, compute: float, comm: float, extra: float, memory: dict, wire: float) -> Prediction:
        step = self.plus_overhead(compute + comm + extra)
        return Prediction(self.c, step, self.global_batch / step, memory, int(wire), compute, comm)


def _data_parallel(m: _Model) -> Prediction:
    p, at = m.p, m.p.at(m.share)
    codec = m.c.option("compression")
    if codec is not None:
        cost = m.codecs.get(str(codec))
        if cost is None:
            raise OutsideCalibration(f"codec {codec} was not measured")
        comm = m.t.time("allreduce:native", cost.sum_bytes) + m.t.time("all_gather", m.n * cost.gather_bytes)
        wire = _ring(m.n, cost.sum_bytes) + (m.n - 1) * cost.gather_bytes
        memory = _memory(
            p.param_bytes, p.grad_bytes, p.optimizer_bytes, at.activation_bytes, cost.transient_bytes
        )
        extra = cost.seconds + p.optimizer_s + m.small
        return m.done(at.compute_s, m.exposed(comm, at.backward_s), extra, memory, wire)
    algorithm = str(m.c.option("allreduce"))
    comm = m.t.time(f"allreduce:{algorithm}", p.grad_bytes)
    grads = p.grad_bytes
    if algorithm == "native" or m.spare_core:
        comm = m.exposed(comm, at.backward_s) + (m.t.ddp_extra_s if algorithm == "native" else 0.0)
    elif algorithm == "shm":  # the shared segment of every local process's slot (docs/plan.md#cost-model)
        grads *= m.n // m.c.hosts
    memory = _memory(p.param_bytes, grads, p.optimizer_bytes, at.activation_bytes)
    return m.done(at.compute_s, comm, p.optimizer_s + m.small, memory, _ring(m.n, p.grad_bytes))


def _sharded(m: _Model) -> Prediction:
    p, at, n = m.p, m.p.at(m.share), m.n
    stage = int(m.c.option("stage"))
    optimizer = p.optimizer_s / n + m.small
    if stage == 1:  # loom's CPU path (sharded_flat): an all-reduce of the gradient, one of the parameters
        comm = m.best_allreduce(p.grad_bytes) + m.best_allreduce(p.param_bytes)
        optimizer += p.flat_s  # and the flat copies around them
        # other: the flat copy of the whole gradient it averages, made while the gradients are still held
        memory = _memory(
            p.param_bytes, p.grad_bytes / n, p.optimizer_bytes / n, at.activation_bytes, p.grad_bytes
        )
        return m.done(at.compute_s, comm, optimizer, memory, _ring(n, p.grad_bytes) + _ring(n, p.param_bytes))
    gathers = 2 if stage == 3 else 1
    units = [layer.param_bytes for layer in at.layers if layer.param_bytes]  # FSDP's: each layer's,
    units += [rest] if (rest := p.param_bytes - sum(units)) > 0 else []  # and the parameters outside them
    comm = sum(gathers * m.t.time("all_gather", u) + m.t.time("reduce_scatter", u) for u in units)
    params = p.param_bytes / n if stage == 3 else p.param_bytes
    other = m.fsdp_extra  # FSDP's memory beyond its shards, measured (docs/plan.md#cost-model)
    memory = _memory(params, p.grad_bytes / n, p.optimizer_bytes / n, at.activation_bytes, other)
    wire = (n - 1) / n * (gathers * p.param_bytes + p.grad_bytes)
    fixed = len(units) * m.t.fsdp_unit_s.get(f"stage{stage}", 0.0)  # FSDP's own work per unit, measured
    return m.done(at.compute_s, m.exposed(comm, at.backward_s), optimizer + fixed, memory, wire)


def _parameter_server(m: _Model) -> Prediction:
    p, at, n, s = m.p, m.p.at(m.share), m.n, m.c.servers
    grads, params = p.grad_bytes / s, p.param_bytes / s
    limit = WireLimits().max_payload
    if max(grads, params) > limit:
        return Prediction(m.c, refused=f"does not run: each server's frame of {int(max(grads, params))} bytes is "
                                       f"above the parameter servers' wire limit of {limit} bytes (more servers)")  # fmt: skip
    if m.t.ps_fixed_s is None:
        raise OutsideCalibration("a parameter server's fixed cost per step was not measured")
    push = m.t.time("ps_encode", grads) + n * m.t.time("ps_decode", grads)
    reply = n * m.t.time("ps_encode", params) + m.t.time("ps_decode", params)
    if m.t.hosts > 1 and m.t.link_bytes_per_s:  # every worker's push and reply cross each server's link
        push = max(push, n * grads / m.t.link_bytes_per_s)
        reply = max(reply, n * params / m.t.link_bytes_per_s)
    # the replies: every server's payload decoded into a copy of its own (`loom.ps.wire.decode`), all held until
    # they are written into the parameters, and the frame being decoded beside them
    frames = p.param_bytes * (1 + 1 / s)
    memory = _memory(p.param_bytes, p.grad_bytes, 0, at.activation_bytes, frames)
    rate = m.t.ps_save_bytes_per_s  # each server's checkpoint of its shard, after every step, before replying
    save = (p.param_bytes + p.optimizer_bytes) / s / rate if rate else 0.0
    extra = p.optimizer_s / s + 2 * m.small + m.t.ps_fixed_s + save
    return m.done(at.compute_s, push + reply, extra, memory, p.grad_bytes)


def _replicas(m: _Model) -> Prediction:
    p, at, n = m.p, m.p.at(m.share), m.n
    period = int(m.c.option("sync_every"))
    outer = p.optimizer_s if m.c.family == "DiLoCo" else 0.0
    comm = (m.best_allreduce(p.param_bytes) + outer) / period
    other = 4 * p.param_bytes if m.c.family == "DiLoCo" else p.param_bytes  # the docstring's buffers
    memory = _memory(p.param_bytes, p.grad_bytes, p.optimizer_bytes, at.activation_bytes, other)
    return m.done(at.compute_s, comm, p.optimizer_s + m.small, memory, _ring(n, p.param_bytes) / period)


def _tensor_parallel(m: _Model) -> Prediction:
    """Megatron's MLP split over ``t`` processes, each with the whole batch: a pair's layers compute a ``1/t``
    share; its row-parallel output is all-reduced in forward, its input gradient in backward (none for a pair
    whose input is the data); everything else is replicated."""
    p, c, t = m.p, m.c, m.c.tp
    if not p.tp_pairs:
        raise OutsideCalibration(f"TensorParallel is not predicted for this model: {p.tp_refusal}")
    if c.dp > 1:
        raise OutsideCalibration("a data axis beside tensor parallelism is not predicted")
    at = p.at(m.share)
    layers = at.layers
    split = {i for a, b in p.tp_pairs for i in range(a, b + 1)}
    inside = {i for a, b in p.tp_pairs for i in range(a + 1, b + 1)}  # the first layer saves its whole input
    compute = sum((x.forward_s + x.backward_s) / (t if i in split else 1) for i, x in enumerate(layers))
    compute += max(0.0, at.compute_s - sum(x.forward_s + x.backward_s for x in layers))  # the loss
    reduced = [layers[b].output_bytes for _, b in p.tp_pairs]
    reduced += [layers[a - 1].output_bytes for a, _ in p.tp_pairs if a > 0]
    comm = sum(_tp_all_reduce(m.t, d) for d in reduced)
    cut = sum(layers[i].param_bytes for i in split)
    f = ((p.param_bytes - cut) + cut / t) / max(1, p.param_bytes)
    acts = sum(x.saved_bytes / (t if i in inside else 1) for i, x in enumerate(layers))
    memory = _memory(p.param_bytes * f, p.grad_bytes * f, p.optimizer_bytes * f, acts)
    wire = sum(_ring(t, d) for d in reduced)
    return m.done(compute, comm, p.optimizer_s * f + m.small, memory, wire)


def _tp_all_reduce(t: Transport, nbytes: float) -> float:
    """The all-reduce a tensor-parallel layer runs (`TensorParallelComm.all_reduce`): on one host shared memory,
    in one barrier up to `loom.comm.shm_small.MAX_BYTES` (``small_allreduce``) and `loom.comm.shm`'s above; the
    backend's across hosts (the transport then has neither)."""
    if "small_allreduce" in t.seconds and nbytes <= t.finite_up_to("small_allreduce"):
        return t.time("small_allreduce", nbytes)
    return t.time("allreduce:shm" if "allreduce:shm" in t.seconds else "allreduce:native", nbytes)


def _pipeline(m: _Model) -> Prediction:
    p, c = m.p, m.c
    if not p.chain:
        raise OutsideCalibration(f"not a chain Pipeline can cut: {p.chain_refusal}")
    micro = int(c.option("microbatches"))
    schedule = str(c.option("schedule"))
    at = p.at(max(1, math.ceil(m.share / micro)))
    layers = at.layers
    ranges = stage_ranges(balanced_cuts([float(x.param_count) or 1.0 for x in layers], c.pp), len(layers))
    fwd = [sum(x.forward_s for x in layers[a:b]) for a, b in ranges]
    bwd = [sum(x.backward_s for x in layers[a:b]) for a, b in ranges]
    fwd[-1] += max(0.0, at.forward_s - sum(fwd))  # the loss runs on the last stage
    bwd[-1] += max(0.0, at.backward_s - sum(bwd))
    boundary = max((layers[b - 1].output_bytes for _, b in ranges[:-1]), default=0)
    message = m.t.time("p2p", boundary) / 2 if boundary else 0.0
    replay = simulate(schedule, c.pp, micro, fwd, bwd, message)
    shares = [sum(x.param_bytes for x in layers[a:b]) / max(1, p.param_bytes) for a, b in ranges]
    biggest = max(range(c.pp), key=lambda s: shares[s])
    data_axis = m.best_allreduce(p.grad_bytes * shares[biggest]) if c.dp > 1 else 0.0
    live = [peak_live_microbatches(stage_instructions(schedule, s, c.pp, micro)) for s in range(c.pp)]
    acts = [sum(x.saved_bytes for x in layers[a:b]) * live[s] for s, (a, b) in enumerate(ranges)]
    f = shares[biggest]
    # one host: the data axis averages through `SharedGradients` over its group, one slot per member, all counted
    slots = c.dp if c.dp > 1 and c.hosts == 1 else 1
    memory = _memory(p.param_bytes * f, slots * p.grad_bytes * f, p.optimizer_bytes * f, max(acts))
    step = m.plus_overhead(replay.makespan + p.optimizer_s * f + data_axis + 2 * m.small)
    wire = 2 * micro * boundary + (_ring(c.dp, p.grad_bytes * f) if c.dp > 1 else 0)
    return Prediction(c, step, m.global_batch / step, memory, int(wire), sum(replay.busy) / c.pp,
                      step - sum(replay.busy) / c.pp, replay.bubble)  # fmt: skip


_FORMULAS = {"DataParallel": _data_parallel, "ShardedDataParallel": _sharded, "ParameterServer": _parameter_server,
             "LocalSGD": _replicas, "DiLoCo": _replicas, "TensorParallel": _tensor_parallel}  # fmt: skip


def predict(
    config: Configuration,
    profile: ModelProfile,
    transport: Transport,
    global_batch: int,
    codecs: dict[str, CodecCost] | None = None,
    spare_core: bool = False,
    overhead_s: float = 0.0,
    runtime_bytes: int = 0,
    fsdp_extra: int = 0,
) -> Prediction:
    """``config``'s prediction by the table of docs/plan.md#cost-model; a `Prediction` with ``refused`` set when the
    configuration is not modelled or would need a measurement the plan did not make (never extrapolated).
    ``fsdp_extra``: ``R_z``, charged to ZeRO stages 2 and 3 alike (docs/plan.md#cost-model)."""
    try:
        m = _Model(config, profile, transport, global_batch, codecs or {}, spare_core, overhead_s, fsdp_extra)
        got = _FORMULAS.get(config.family, _pipeline)(m)
    except OutsideCalibration as why:
        return Prediction(config, refused=f"outside the calibrated range: {why}")
    return _with_process(got, profile, runtime_bytes)


def _with_process(got: Prediction, profile: ModelProfile, runtime_bytes: int) -> Prediction:
    """The peak of the whole process: the step's temporaries (a pipeline stage's in proportion to its
    parameters) and the process's runtime (docs/plan.md#cost-model) added to the training state and activations."""
    memory = dict(got.memory)
    share = memory["parameters"] / profile.param_bytes if got.config.family == "Pipeline" else 1.0
    memory["transient"] = int(profile.transient_bytes * share)
    memory["runtime"] = int(runtime_bytes)
    memory["total"] = sum(v for k, v in memory.items() if k != "total")
    return dataclasses.replace(got, memory=memory)
