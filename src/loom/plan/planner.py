"""`plan`: capture the script, measure, predict every configuration, rank; `verify`: run the top ones.

In that order: the script runs to its loader (`loom.plan.capture`); the model trains a few steps at each batch
size the configurations need (`loom.plan.profile`); one ``loom run -n N`` job measures the transport and the
engine runs behind the overhead and overlap coefficient (`loom.plan.trial`); predicting is arithmetic
(`loom.plan.cost`). What each part costs is the result's ``seconds``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.errors import PlanError
from loom.plan.capture import CapturedScript, capture_script
from loom.plan.codecs import CodecCost, gradient_like, measure_codec
from loom.plan.configs import CODECS, Configuration, batch_sizes, candidates
from loom.plan.cost import Prediction, predict
from loom.plan.profile import ModelProfile, _layers, profile_model  # _layers: the list the profile times
from loom.plan.recommend import Ranked, last_errors, needed_per_process, rank, record_errors
from loom.plan.transport import Transport
from loom.plan.trial import QUIET
from loom.ps.wire import WireLimits

__all__ = ["PlanError", "PlanResult", "Verification", "plan", "verify"]


@dataclass
class Verification:
    config: Configuration
    predicted_s: float
    measured_s: float
    predicted_state: int
    measured_state: int
    predicted_peak: int = 0
    """The predicted peak RSS of the largest process (`Prediction.memory`'s total)."""
    measured_peak: int = 0
    """The largest process's peak RSS (``VmHWM``) over the run."""

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    @classmethod
    def of(cls, prediction: Prediction, got: dict[str, Any]) -> Verification:
        """``prediction`` beside what a `loom.plan.trial` verify run wrote (``got``)."""
        p, memory = prediction, got["memory"]
        state = p.memory["parameters"] + p.memory["gradients"] + p.memory["optimizer"]
        return cls(p.config, p.step_time_s, float(got["step_time_s"]), state, int(memory["state"]),
                   p.memory["total"], int(memory["peak_rss"]))  # fmt: skip


@dataclass
class PlanResult:
    script: str
    nproc: int
    hosts: int
    global_batch_size: int
    profile: ModelProfile
    transport: Transport
    ranked: list[Ranked]
    overhead_s: float
    """The step engine's time per step no formula contains (`loom.plan.cost`), measured."""
    seconds: dict[str, float]
    """Wall time of each phase: capture, profile, transport, predict."""
    job_share: int = 0
    """Each worker's share of what the job's other processes hold of their own (the launcher, the zygote):
    added to a configuration's peak when it is judged against ``--memory-per-proc``."""
    pipeline_overhead_s: float = 0.0
    """The same for the pipeline schedules (`Pipeline`, `Hybrid`), from the calibration's pipeline run."""

    @property
    def top(self) -> Ranked:
        return self.ranked[0]


def _fsdp_extra(measured: dict, profile: ModelProfile, local: Transport, batch: int, nproc: int,
                runtime: int) -> int:  # fmt: skip
    """``R_z`` (`loom.plan.cost`): ZeRO-3's measured peak on ``nproc`` processes less its formula's total, for
    stages 2 and 3 alike (`loom.plan.trial._fsdp_peak`: stage 2 holds less beyond its formula); 0 unmeasured."""
    peak = measured.get("fsdp_peak_rss")
    if not peak:
        return 0
    config = Configuration("ShardedDataParallel", nproc, (("stage", 3),), dp=nproc)
    formula = predict(config, profile, local, batch, runtime_bytes=runtime)
    return max(0, int(peak) - formula.memory.get("total", int(peak)))


def _overhead(measured_s: float, formula: Prediction) -> float:
    """The engine overhead (`loom.plan.cost`): a calibration run's measured step less its formula's (the quiet
    run's, no exchange; the pipeline's). Negative where the profile timed the compute slower than the job ran it
    (its noise): a correction every configuration of that engine shares; at most half the formula's step."""
    return max(-formula.step_time_s / 2, float(measured_s) - formula.step_time_s)


PIPELINES = ("Pipeline", "Hybrid")
"""The families whose step is a pipeline schedule: their engine overhead is the calibration pipeline's."""


def _pipeline_probe(nproc: int, chain: bool, chain_length: int, batch: int) -> Configuration | None:
    """The pipeline the calibration times (`loom.plan.trial`'s ``--pipeline``), or None for a model Pipeline
    cannot cut: the most stages (``nproc`` where the chain is that long; else a `Hybrid`), the fewest
    micro-batches, GPipe. Its measured step less its replay is the overhead of every pipeline configuration: a
    schedule runs each stage's share of the step with less contention than the data-parallel family, whose
    processes each run the whole model's step in lockstep and contend for memory bandwidth."""
    if not chain:
        return None
    found = [c for c in candidates(nproc, ("native",), chain_length, batch) if c.family in PIPELINES]
    return min(found, key=lambda c: (-c.pp, c.option("microbatches"), c.option("schedule") != "gpipe"),
               default=None)  # fmt: skip


def _with_overlap(local: Transport, measured: dict, profile: ModelProfile, reference: Configuration,
                  batch: int) -> Transport:  # fmt: skip
    """``local`` with the overlap coefficient ``k`` and ``ddp_extra_s`` from the reference's and the quiet run's
    steps, as docs/plan.md#what-it-measures derives them, so that the reference's own prediction is its measured
    step. Both steps are the engine's on the same model and data: what they share (the engine, the cores'
    contention) cancels."""
    backward = profile.at(math.ceil(batch / reference.dp)).backward_s
    x = local.time("allreduce:native", profile.grad_bytes)
    exposed = float(measured["reference_step_s"]) - float(measured["quiet_step_s"])
    hidden = max(1e-9, min(x, backward))
    k = max(-1.0, min(1.0, (x - exposed) / hidden))
    return dataclasses.replace(local, overlap=k, ddp_extra_s=max(0.0, exposed - (x - k * hidden)))


def _trial(mode: str, script: str, args: tuple[str, ...], nproc: int, servers: int, options: list[str],
           timeout_s: float) -> dict:  # fmt: skip
    """Run `loom.plan.trial` under ``loom run`` and return what rank 0 wrote (PlanError naming the failure)."""
    with tempfile.TemporaryDirectory(prefix="loom-plan-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "loom.cli", "run", "-n", str(nproc), "--run-dir", f"{tmp}/run"]
        command += ["--servers", str(servers)] if servers else []
        command += ["-m", "loom.plan.trial", mode, "--out", str(out), *options, script, *args]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise PlanError(f"loom plan: the {mode} run ({' '.join(options)}) took over {timeout_s:.0f} s and was "
                            "stopped. HINT: a smaller --steps, or a smaller model") from None  # fmt: skip
        if done.returncode != 0 or not out.exists():
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise PlanError(f"loom plan: the {mode} run failed (exit {done.returncode}): {tail}")
        if (size := out.stat().st_size) > 1 << 22:
            raise PlanError(f"loom plan: the {mode} run wrote {size} bytes; expected a small JSON")
        return json.loads(out.read_text())


def _message_sizes(profile: ModelProfile, codecs: dict[str, CodecCost], n: int) -> list[int]:
    """The sizes the transport is measured at: exactly the whole-model messages (gradients, parameters, a
    parameter server's share of every worker's, each codec's), and a grid a factor of 4 apart up to the
    largest per-layer message (FSDP units, pipeline activations), which those are interpolated on; above it,
    between the exact sizes, a message is bandwidth-bound (time to plan: no grid of 100 MB messages)."""
    p = profile
    exact = {8, p.grad_bytes, p.param_bytes, p.grad_bytes // 2, p.param_bytes // 2}  # // 2: one of 2 servers
    for c in codecs.values():
        exact |= {c.sum_bytes, n * c.gather_bytes}
    layers = [x for at in p.batches.values() for x in at.layers]
    per_layer = max((m for x in layers for m in (x.output_bytes, x.param_bytes)), default=8)
    grid = {8 * 4**i for i in range(32) if 8 * 4**i < per_layer}  # 8 * 4**31 bytes: above any message
    return sorted(s for s in exact | grid | {per_layer} if s > 0)


def _limits(profile: ModelProfile, codecs: dict[str, CodecCost], n: int) -> dict[str, int]:
    """The largest message the cost model asks of each operation family (`loom.plan.cost`): the transport is
    measured up to it and no further (an all-gather of a pipeline's activation size is never asked for, a 300 MB
    point-to-point message neither). All-reduces serve every whole-model message."""
    p = profile
    layers = next(iter(p.batches.values())).layers  # the parameters are the same at every batch size
    unit = max([x.param_bytes for x in layers] + [p.param_bytes - sum(x.param_bytes for x in layers)])
    outputs = max((x.output_bytes for at in p.batches.values() for x in at.layers), default=8)
    gathers = max((n * c.gather_bytes for c in codecs.values()), default=0)
    return {"reduce_scatter": unit, "all_gather": max(unit, gathers), "p2p": outputs,
            "ps": max(p.grad_bytes, p.param_bytes)}  # fmt: skip


COALESCE = 0.02
"""Sizes this close below a larger one are measured at the larger (`coalesce`)."""


def coalesce(sizes: list[int], limits: dict[str, int], cap: int) -> tuple[list[int], dict[str, int]]:
    """``sizes`` less those within `COALESCE` below the next one kept, and ``limits`` raised to the size that
    stands for them, never across ``cap`` (a parameter server's largest frame, `loom.ps.wire.WireLimits`): a
    gradient's half for one of 2 servers and a codec's gathered message a fraction of a percent apart need not
    each be measured whole (time to plan); between measured sizes the transport interpolates
    linearly in bytes, exact where a message is bandwidth-bound as messages of this size are."""
    kept: list[int] = []
    for size in sorted(sizes, reverse=True):
        if kept and size >= kept[-1] * (1 - COALESCE) and (size > cap or kept[-1] <= cap):
            continue
        kept.append(size)
    kept.reverse()
    stand = {s: next(k for k in kept if k >= s) for s in sizes}
    return kept, {k: stand.get(v, v) for k, v in limits.items()}


def check_fits(ranked: list[Ranked], memory_limit: int | None, job_share: int = 0) -> None:
    """Refuse a memory limit no predicted configuration fits (PlanError naming the smallest and what it needs)."""
    predicted = [r.prediction for r in ranked if not r.prediction.refused]
    if memory_limit is None or not predicted or any(r.feasible for r in ranked):
        return
    smallest = min(predicted, key=lambda p: p.memory["total"])
    raise PlanError(
        f"loom plan: no configuration fits --memory-per-proc {memory_limit} bytes: the smallest, "
        f"{smallest.config.strategy} [{smallest.config.launch}], needs {needed_per_process(smallest, job_share)} "
        "bytes per process. HINT: raise --memory-per-proc, or plan more processes (--nproc)"
    )


def plan(
    script: str,
    args: tuple[str, ...] = (),
    nproc: int = 2,
    hosts: int = 1,
    link_bytes_per_s: float | None = None,
    memory_limit: int | None = None,
    timeout_s: float = 300.0,
) -> PlanResult:
    """Plan ``script`` on ``nproc`` processes per host on ``hosts`` hosts (the module docstring)."""
    if nproc * hosts < 2:
        raise PlanError(
            "loom plan compares ways to divide training: it needs at least 2 processes. HINT: --nproc 2"
        )
    if memory_limit is not None and memory_limit <= 0:
        raise PlanError(f"--memory-per-proc must be positive, got {memory_limit}")
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    captured: CapturedScript = capture_script(script, args)
    seconds["capture"] = time.perf_counter() - started
    batch = captured.global_batch_size
    world = nproc * hosts
    algorithms = ("native", "ring", "shm") if hosts == 1 else ("native", "ring")
    chain_layers, is_chain, _ = _layers(captured.model)
    chain = len(chain_layers)
    configs = [dataclasses.replace(c, hosts=hosts) for c in candidates(world, algorithms, chain, batch)]
    # The calibration job runs on this host: nproc processes, at least 2 (one process per host still needs a
    # measured floor for its collectives, and the engine overhead of a job that has peers).
    calibrated = max(2, nproc)
    reference = Configuration("DataParallel", calibrated, (("allreduce", "native"),), dp=calibrated)
    probe = _pipeline_probe(calibrated, is_chain, chain, batch)
    t = time.perf_counter()
    probes = [reference] + ([probe] if probe else [])
    profile = profile_model(captured, batch_sizes([*configs, *probes], batch))
    seconds["profile:model"] = time.perf_counter() - t
    gradient = gradient_like(captured.model)
    codecs = {spec: measure_codec(spec, captured.model, world, gradient=gradient) for spec in CODECS}
    del gradient
    seconds["profile"] = time.perf_counter() - t
    t = time.perf_counter()
    limits = _limits(profile, codecs, world)
    sizes = sorted(set(_message_sizes(profile, codecs, world)) | {v for v in limits.values() if v > 0})
    sizes, limits = coalesce(sizes, limits, WireLimits().max_payload)
    options = ["--sizes", ",".join(map(str, sizes)), "--limits", json.dumps(limits)]
    options += ["--pipeline", json.dumps({probe.family: dict(probe.options)})] if probe else []
    servers = int(any(c.family == "ParameterServer" for c in configs))  # its fixed cost is measured
    measured = _trial("calibrate", script, args, calibrated, servers, options, timeout_s)
    spare = (os.cpu_count() or 1) > nproc * profile.threads
    local = _with_overlap(Transport.from_json(measured), measured, profile, reference, batch)
    transport = dataclasses.replace(local, world_size=world, hosts=hosts,
                                    link_bytes_per_s=link_bytes_per_s)  # fmt: skip
    if hosts > 1:
        for op in ("allreduce:shm", "small_allreduce"):  # one host's shared memory: not across hosts
            transport.seconds.pop(op, None)
    seconds["transport"] = time.perf_counter() - t  # the whole calibration job, its parts below
    seconds.update({f"calibration:{k}": float(v) for k, v in measured.get("calibration_seconds", {}).items()})
    t = time.perf_counter()
    formula = predict(reference, profile, local, batch, codecs, spare)
    quiet = Configuration("LocalSGD", calibrated, (("sync_every", QUIET),), dp=calibrated)
    overhead = _overhead(measured["quiet_step_s"], predict(quiet, profile, local, batch))
    overheads = {family: overhead for family in {c.family for c in configs}}
    if probe and "pipeline_step_s" in measured:
        replay = predict(probe, profile, local, batch)
        overheads.update({f: _overhead(measured["pipeline_step_s"], replay) for f in PIPELINES})
    # The process's runtime memory (docs/plan.md#what-it-measures): the reference's measured peak less its
    # formula's total; where no peak could be read (no /proc), the RSS after the script's set-up less its model
    runtime = int(measured.get("runtime_bytes", 0))
    if measured.get("reference_peak_rss"):
        runtime = max(0, int(measured["reference_peak_rss"]) - formula.memory["total"])
    fsdp_extra = _fsdp_extra(measured, profile, local, batch, calibrated, runtime)
    predictions: list[Prediction] = [
        predict(c, profile, transport, batch, codecs, spare, overheads[c.family], runtime, fsdp_extra)
        for c in configs
    ]
    # The launcher and the zygote hold memory of their own; the workers' RSS counts the pages they share with
    # the zygote once each, a cgroup (a container, the machine) once: the job needs N peaks plus the difference
    shared = (nproc - 1) * int(measured.get("worker_shared_bytes", 0))
    job_share = max(0, int(measured.get("launcher_private_bytes", 0)) - shared) // max(1, nproc)
    ranked = rank(predictions, memory_limit, last_errors(), job_share)
    seconds["predict"] = time.perf_counter() - t
    check_fits(ranked, memory_limit, job_share)
    pipeline = overheads.get("Pipeline", overhead)
    return PlanResult(
        script, nproc, hosts, batch, profile, transport, ranked, overhead, seconds, job_share, pipeline
    )


def verify(result: PlanResult, args: tuple[str, ...] = (), top: int = 2, steps: int = 5,
           timeout_s: float = 300.0) -> list[Verification]:  # fmt: skip
    """Run the ``top`` feasible configurations ``steps`` steps each under ``loom run``; record each family's
    step-time error as its last verification."""
    if result.hosts > 1:
        raise PlanError("loom plan --verify runs on this host only; several hosts are not verified yet. HINT: drop "
                        "--verify, or plan --hosts 1")  # fmt: skip
    out = []
    for r in [r for r in result.ranked if r.feasible][:top]:
        c, p = r.prediction.config, r.prediction
        options = ["--family", c.family, "--options", json.dumps(dict(c.options)), "--steps", str(steps)]
        got = _trial("verify", result.script, args, c.nproc, c.servers, options, timeout_s)
        out.append(Verification.of(p, got))
    record_errors({v.config.family: v.error for v in out if math.isfinite(v.error)})
    return out
