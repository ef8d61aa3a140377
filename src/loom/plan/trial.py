"""The planner's measurements that need several processes, run as ``loom run -n N -m loom.plan.trial ...``.

    loom run -n N -m loom.plan.trial calibrate --out F --sizes 4096,65536 SCRIPT [ARGS...]
    loom run -n N [--servers S] -m loom.plan.trial verify --out F --family DataParallel --options '{}' SCRIPT ...

Both run the user's script up to its ``job.loader(...)`` (`loom.plan.capture`) in every worker, so every rank
holds the model, optimizer, loss and data the script would build. Rank 0 writes ``--out`` as JSON.

``calibrate``: the process's runtime bytes, the transport at ``--sizes`` (`measure_transport`), the step of the
reference ``DataParallel(allreduce="native")`` (``reference_step_s``), of the quiet run (`QUIET`,
``quiet_step_s``) and with ``--pipeline`` of a pipeline (``pipeline_step_s``), ZeRO-3's peak RSS (`_fsdp_peak`)
and the fixed costs (`_fixed_costs`); what each is and why: docs/plan.md#what-it-measures. ``verify``: the
configuration itself, built from its family and options by name (no ``eval``), a few real steps (`_verify_steps`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loom.checkpoint.durable import replace_durable
from loom.plan.transport_timing import rank_max

__all__ = ["main"]


BUDGET_S = 3.0
"""The calibration's repeated measurements (the reference's and the quiet run's steps) stop at about this much
time each, after the first: a model whose step takes a second is timed a few times, not a dozen (time to plan)."""

STEPS = 40
"""The reference's and the quiet run's timed steps, at most (`BUDGET_S` caps them for a slow step): their
difference is the native all-reduce's exposed time, small beside the step, so it needs many steps."""

QUIET = 10**9
"""The quiet run's ``sync_every``: `LocalSGD` that never synchronizes within the calibration, so its step is loom's
step engine with no gradient exchange (the engine overhead's measurement, `loom.plan.cost`)."""


def _copy(captured: Any) -> Any:
    """The captured model and a fresh optimizer of the same kind and settings over the copy (each calibration
    run trains its own, so the script's model stays untouched and every run starts from the same state)."""
    model = copy.deepcopy(captured.model)
    optimizer = type(captured.optimizer)(model.parameters(), **captured.optimizer.defaults)
    return dataclasses.replace(captured, model=model, optimizer=optimizer)


def _calibrate(ns: argparse.Namespace, captured: Any) -> dict:
    from loom.observe.memory import reset_peak_rss, rss_bytes
    from loom.plan.transport_timing import measure_transport
    from loom.topology import current

    params = sum(p.nbytes for p in captured.model.parameters())
    (runtime,) = rank_max([float((rss_bytes() or 0) - params)], current().group)
    # Every prediction carries this step's residuals (the engine overhead; the process's memory beyond the
    # formulas'): timed longer than a verify run, and run first, so that its peak RSS is not the transport's
    clock, parts = time.perf_counter(), {}

    def done(part: str) -> None:  # the calibration's seconds by part (`PlanResult.seconds`: time to plan)
        nonlocal clock
        parts[part], clock = time.perf_counter() - clock, time.perf_counter()

    reset_peak_rss()
    # one untimed step (its optimizer state, DDP's first iteration); the second, DDP's rebuilt buckets' first, is
    # one of at least 3 timed blocks, whose median does not see it
    trained, steps = _copy(captured), max(ns.steps, STEPS)
    reference = _verify_steps(trained, "DataParallel", {"allreduce": "native"}, steps, 1, budget=True)
    done("reference")
    transport = measure_transport([int(s) for s in ns.sizes.split(",")], json.loads(ns.limits))
    done("transport")
    # the same steps with no exchange (what for: docs/plan.md#what-it-measures), on the reference's copy, its
    # optimizer state made, once the reference's DDP has let go of it (its reducer's hooks go with it)
    gc.collect()
    # no warm-up step: the reference made the optimizer state; a slower first block is outside the median of 3+
    quiet = _verify_steps(trained, "LocalSGD", {"sync_every": QUIET}, steps, 0, budget=True)
    done("quiet")
    data = transport.to_json()
    if ns.pipeline:  # the pipeline engine's own overhead (planner): last, it empties other stages' parameters
        gc.collect()
        ((family, options),) = json.loads(ns.pipeline).items()
        pipeline = _verify_steps(trained, family, options, steps, 0, budget=True)
        data["pipeline_step_s"] = pipeline["step_time_s"]
        done("pipeline")
    del trained
    data["reference_step_s"] = reference["step_time_s"]
    data["quiet_step_s"] = quiet["step_time_s"]
    # the script's own model stays resident beside the copy the reference trains: not the reference's
    data["reference_peak_rss"] = max(0, reference["memory"]["peak_rss"] - params)
    data["fsdp_peak_rss"] = _fsdp_peak(captured, params)
    done("fsdp_peak")
    # the planner starts the calibration with a parameter server when it plans some
    data.update(_fixed_costs(captured, max(ns.steps, 10), bool(os.environ.get("LOOM_PS_ADDRS"))))
    done("fixed_costs")
    data["calibration_seconds"] = parts
    data["runtime_bytes"] = max(0, int(runtime))
    data["launcher_private_bytes"] = _launcher_private_bytes()
    data["worker_shared_bytes"] = _private_bytes(os.getpid(), shared=True)
    return data


def _fsdp_peak(captured: Any, params: int) -> int:
    """The peak RSS (the largest rank's, less the script's own model as the reference's) of a step of ZeRO
    stage 3 on a copy of the model whose optimizer state exists (`_prime`), as at every step after the first,
    from a trimmed heap (`reset_peak_rss`). Stage 3 only (time to plan): it gathers every unit twice a step, and
    stage 2's peak is at most its, so the planner charges stage 2 the same memory beyond its formula."""
    from loom.observe.memory import reset_peak_rss

    reset_peak_rss()
    trained = _copy(captured)
    got = _verify_steps(trained, "ShardedDataParallel", {"stage": 3}, 1, 0, prime=True)
    return max(0, got["memory"]["peak_rss"] - params)


def _prime(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state as its first step makes it, without that step's forward, backward and collectives: a
    step on zero gradients (of a throwaway copy of the model). ZeRO-3's peak of one step so primed is that of a
    second step, at the cost of one step fewer (time to plan; the figures are in docs/plan.md)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _private_bytes(pid: int, shared: bool = False) -> int:
    """What process ``pid`` holds alone (``Private_Clean + Private_Dirty`` of ``smaps_rollup``), or with
    ``shared`` what it shares with other processes (the zygote's pages a forked worker has not written): a cgroup
    charges a page once, the RSS of each process sharing it counts it; 0 where ``/proc`` cannot tell."""
    total, kinds = 0, ("Shared_Clean:", "Shared_Dirty:") if shared else ("Private_Clean:", "Private_Dirty:")
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(kinds):
                total += int(line.split()[1]) * 1024
    return total


def _launcher_private_bytes() -> int:
    """The memory of the job's processes that are not workers (the zygote that forked this one, the ``loom run``
    launcher above it), as they hold it alone; 0 where ``/proc`` cannot tell."""
    total, pid = 0, os.getppid()
    with contextlib.suppress(OSError, ValueError, IndexError):
        for _ in range(3):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read(1 << 16).split(b"\0")
            if not any(b"loom" in w for w in words):
                break
            total += _private_bytes(pid)
            if b"loom.cli" in words or (b"run" in words and any(w.endswith(b"/loom") for w in words)):
                break  # the launcher: what started it is not the job's
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return total


FSDP_UNITS = 6


def _tiny(captured: Any, family: str, options: dict[str, Any], steps: int) -> float:
    """The step time of a chain of `FSDP_UNITS` ``Linear(8, 8)`` trained by ``family`` through loom's own step:
    with this little compute and messages of a few hundred bytes, what is left is the strategy's fixed work."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 8))
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(FSDP_UNITS)])
    tiny = dataclasses.replace(captured, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                               loss_fn=torch.nn.functional.mse_loss, dataset=data, global_batch_size=16,
                               loader_options={})  # fmt: skip
    return float(_verify_steps(tiny, family, options, steps, 3)["step_time_s"])


def _fixed_costs(captured: Any, steps: int, servers: bool) -> dict[str, Any]:
    """What strategies cost per step beyond `DataParallel` and beyond their messages' bytes (`_tiny`; the
    engine's overhead cancels): FSDP's fixed work per unit at ZeRO stages 2 and 3 (its hooks, copies, the tiny
    collectives' latency), and with ``servers`` a synchronous parameter server's (its requests' round trips,
    the server's own handling and wake-ups)."""
    dp = _tiny(captured, "DataParallel", {"allreduce": "native"}, steps)
    units = {f"stage{z}": _tiny(captured, "ShardedDataParallel", {"stage": z}, steps) for z in (2, 3)}
    out: dict[str, Any] = {"fsdp_unit_s": {k: max(0.0, (t - dp) / FSDP_UNITS) for k, t in units.items()}}
    if servers:
        out["ps_fixed_s"] = max(0.0, _tiny(captured, "ParameterServer", {"mode": "sync"}, steps) - dp)
        params = sum(p.nbytes for p in captured.model.parameters())
        if dist.get_rank() == 0:  # the one that writes the result; a server writes alone
            out["ps_save_bytes_per_s"] = _save_rate(min(SAVE_BYTES, max(1 << 20, 3 * params)))
    return out


SAVE_BYTES = 64 << 20
"""The largest checkpoint `_save_rate` writes (time to plan: a large model's state is gigabytes)."""


def _save_rate(nbytes: int, reps: int = 3) -> float:
    """Bytes per second of a synchronous parameter server's checkpoint, written as `loom.ps.shard.ModelShard.save`
    writes one after every step by default (a safetensors file beside the last, renamed into place, the last
    removed), ``nbytes`` of it, into a temporary folder in the working directory, where ``loom run`` keeps its
    runs (else the system's): the median of ``reps``. A few large tensors save faster than a real shard's many
    small ones of the same bytes: a floor."""
    from safetensors.torch import save_file

    tensors = {f"t{i}": torch.ones(nbytes // 16) for i in range(4)}  # a shard: parameters and optimizer state
    try:
        folder = tempfile.TemporaryDirectory(prefix=".loom-plan-save-", dir=os.getcwd())
    except OSError:
        folder = tempfile.TemporaryDirectory(prefix="loom-plan-save-")
    times = []
    with folder as name:
        for rep in range(reps):
            started = time.perf_counter()
            path = Path(name) / f"shard.v{rep}.safetensors"
            save_file(tensors, str(path) + ".tmp")
            os.replace(str(path) + ".tmp", path)
            path.with_name(f"shard.v{rep - 1}.safetensors").unlink(missing_ok=True)
            times.append(time.perf_counter() - started)
    return 16 * (nbytes // 16) / max(1e-9, statistics.median(times))


def _strategy(family: str, options: dict[str, Any]) -> Any:
    import loom
    from loom.plan.capture import STRATEGIES

    if family not in STRATEGIES:
        raise ValueError(f"unknown strategy family {family!r} (one of {', '.join(STRATEGIES)})")
    return getattr(loom, family)(**options)


def _block(family: str, options: dict[str, Any]) -> int:
    """Steps per timed block: a whole sync round for LocalSGD/DiLoCo (their exchange happens once per
    ``sync_every`` steps, and the cost model amortizes it over the round: timing single steps would miss or
    catch it by chance), one step otherwise, and for the calibration's quiet run (`QUIET`: no round ends)."""
    period = int(options.get("sync_every", 1)) if family in ("LocalSGD", "DiLoCo") else 1
    return 1 if period == QUIET else period


def _verify_steps(
    captured: Any,
    family: str,
    options: dict[str, Any],
    count: int,
    warmup: int,
    budget: bool = False,
    tensors: bool = False,
    prime: bool = False,
) -> dict:
    """``count`` timed blocks after ``warmup`` untimed steps; a block's time is the slowest rank's, from a barrier
    before its first step to the end of its last, divided by its steps; the result is the median block. With
    ``budget``, fewer blocks (at least 3) when ``count`` of them would take more than `BUDGET_S`, judged on the
    last warm-up step or, with no warm-up, on the first timed block. The peak RSS is always measured; the
    memory's tensor categories only with ``tensors`` (``--verify``, which compares the persistent state), 0
    otherwise: ``job.memory()`` walks every live tensor of the process, the user's model's too, and the
    calibration's runs read their step time and peak alone. With ``prime``, the optimizer's state is made before
    the steps (`_prime`; the job steps the optimizer it was set up with, rebound in place)."""
    from loom.observe.memory import peak_rss_bytes
    from loom.plan.transport_timing import agreed_reps

    job = _strategy(family, options).setup(captured.model, captured.optimizer, captured.loss_fn)
    if prime:
        _prime(captured.optimizer)
    loader = job.loader(captured.dataset, captured.global_batch_size, **captured.loader_options)
    block = _block(family, options)
    batches = _endless(loader)
    warm = 0.0
    for _ in range(warmup):
        started = time.perf_counter()
        job.train_step(next(batches))
        warm = time.perf_counter() - started
    times: list[float] = []
    group = job.topology.group

    def timed_block() -> None:
        dist.barrier(group=group)
        started = time.perf_counter()
        for _ in range(block):
            job.train_step(next(batches))
        times.append((time.perf_counter() - started) / block)

    if budget:
        # with no warm-up the first block is timed, and budgets the rest (the median of 3 or more leaves it out)
        if not warmup:
            timed_block()
        block_s = (warm if warmup else times[0]) * block
        count = agreed_reps(block_s, count, group, BUDGET_S, least=3)
    while len(times) < count:
        timed_block()
    steps = rank_max(times, group)
    keys = ["parameters", "gradients", "optimizer", "state", "total"]
    memory = job.memory() if tensors else dict.fromkeys(keys, 0)
    largest = rank_max([float(memory[k]) for k in keys] + [float(peak_rss_bytes() or 0)], group)
    values = dict(zip([*keys, "peak_rss"], map(int, largest), strict=True))
    return {"step_time_s": statistics.median(steps), "memory": values}


def _endless(loader: Any) -> Any:
    """The loader's batches, epoch after epoch."""
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield from loader


def main(argv: list[str] | None = None) -> int:
    import loom
    from loom.plan.capture import capture_script

    parser = argparse.ArgumentParser(prog="python -m loom.plan.trial")
    parser.add_argument("mode", choices=["calibrate", "verify"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default="4096,65536,1048576")
    parser.add_argument("--limits", default="{}", help="JSON: each operation family's largest size (bytes)")
    parser.add_argument(
        "--pipeline", default="", help='calibrate: a pipeline to time too, {"Pipeline": {...}}'
    )
    parser.add_argument("--family", default="DataParallel")
    parser.add_argument("--options", default="{}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    topology = loom.init()
    captured = capture_script(ns.script, tuple(ns.args))
    if ns.mode == "calibrate":
        result = _calibrate(ns, captured)
    else:
        result = _verify_steps(captured, ns.family, json.loads(ns.options), ns.steps, warmup=2, tensors=True)
    if topology.rank == 0:
        replace_durable(ns.out, json.dumps(result).encode())
    loom.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
