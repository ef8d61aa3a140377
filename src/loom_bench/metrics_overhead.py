"""Cost of `loom.observe`: step time with metrics on vs off, interleaved in the same run.

``python -m loom_bench.metrics_overhead [--model cnn|mlp] [--nproc 2] [--repetitions 12] [--steps 40] [--out DIR]``

Jobs train the same model side by side: ``cnn``, the demo CNN on the 8x8 digits (global batch 64, a step of a
few ms: the worst case for a fixed per-step cost), or ``mlp``, the benchmark MLP of `loom bench dp`
(784-1024-1024-10, synthetic data, global batch 256, a step of ~20-40 ms here). They share one process group:
one with ``DataParallel(observe=True)`` (phase timing, the timed DDP hook, bytes, each step's phase times into the
straggler watch's window, JSON lines written to a file) and two with ``observe=False`` (no records at all, the same all-reduce
algorithm; the second is the `MODES` control). Their steps alternate one by one (which goes first rotates too),
so all modes see the same machine: on
a shared 2-core box the speed drifts by tens of percent over a fraction of a second, which drowned the effect
when whole blocks of steps (or whole repetitions with a fresh model and DDP) ran in one mode at a time.
The step time is measured from outside the strategy (wall time around ``train_step``; the median step of
each repetition, robust to preemption on a shared machine), so whatever the observer costs is in it. The
overhead is the median over repetitions of the paired ratio ``on / off - 1``.

Writes ``metrics_overhead.json``, ``.md`` and ``.png`` into ``--out`` (``metrics_overhead_mlp.*`` for the MLP).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["measure_overhead"]

MODES = ("on", "off", "control")
"""``control`` is a second job with metrics off: its difference from ``off`` is what noise alone gives."""


MODELS = {
    "cnn": "demo CNN on the 8x8 digits, global batch 64",
    "mlp": "MLP 784-1024-1024-10, synthetic data, global batch 256",
}


def _model_and_data(model: str):
    """(model, training set, global batch) of ``model``."""
    if model == "mlp":
        from loom_bench.dp_worker import bench_model, synthetic_data

        return bench_model(), synthetic_data(256, 8), 256
    from loom.demo.train import digits_cnn, digits_datasets

    return digits_cnn(), digits_datasets()[0], 64


def _options(pairs: list[str]) -> dict:
    """``["overlap=True", "allreduce=native"]`` -> DataParallel's keyword options (Python literals, else strings)."""
    import ast

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option {pair!r}: expected KEY=VALUE, e.g. overlap=True")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def _worker(model_name: str, repetitions: int, steps: int, out: Path, options: dict | None = None) -> None:
    import torch
    from torch import nn

    import loom

    topo = loom.init()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="loom-overhead-") as tmp:
        jobs = {}
        for mode in MODES:  # every job lives for the whole run: repetitions differ only in the mode
            model, train_set, global_batch = _model_and_data(model_name)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            path = f"{tmp}/rank{topo.rank}.jsonl" if mode == "on" else None
            strategy = loom.DataParallel(observe=mode == "on", metrics_path=path, **(options or {}))
            jobs[mode] = strategy.setup(model, optimizer, nn.functional.cross_entropy)
        loader = loom.data.loader(train_set, global_batch, seed=0)
        batches = [b for _, b in zip(range(steps + 2), _forever(loader), strict=False)]
        for job in jobs.values():
            for batch in batches[:2]:  # warm-up
                job.train_step(batch)
        torch.distributed.barrier()
        for rep in range(repetitions):
            step_times: dict[str, list[float]] = {mode: [] for mode in MODES}
            for i, batch in enumerate(batches[2:]):
                # the modes take turns step by step (who goes first rotates too): all see the same machine
                first = (rep + i) % len(MODES)
                for mode in MODES[first:] + MODES[:first]:
                    started = time.perf_counter()
                    jobs[mode].train_step(batch)
                    step_times[mode].append(time.perf_counter() - started)
            for mode, values in step_times.items():
                # the median step, not the mean: robust to the other processes of a busy machine preempting us
                times[mode].append(statistics.median(values))
        jobs["on"].metrics.close()
    if topo.is_main:
        out.write_text(json.dumps(times))


def _forever(loader):
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def direct_cost_us(world_size: int = 2, steps: int = 3000, trials: int = 5) -> float:
    """The observer's own work per step on rank 0 (clock, records, JSON line, the straggler watch's window), in µs.

    Best of ``trials`` loops over the calls a strategy makes, minus the loop doing only what the strategy does
    anyway (a one-element loss buffer): CPU work measured without the noise of a 2-process step.
    """
    import torch

    from loom.observe.metrics import StepMetrics
    from loom.observe.phases import COMM, DATA, OPTIMIZER, StepObserver
    from loom.observe.straggler_watch import StragglerWatch

    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="loom-overhead-") as tmp:
        metrics = StepMetrics(0, Path(tmp) / "rank0.jsonl")
        observer = StepObserver(metrics, world_size)
        watch = StragglerWatch([list(range(world_size))])  # judged on the watchdog's thread

        def observed(i: int) -> None:
            observer.begin_step(i + 1)
            observer.lap(DATA)
            observer.lap(COMM)
            observer.lap(OPTIMIZER)
            buffer = observer.loss_buffer(cpu)
            buffer[0] += 1.0
            observer.backward_done()
            observer.lap(OPTIMIZER)
            observer.end_step(i + 1, 32, 64, 1.0)
            watch.add(*observer.last_phases)  # type: ignore[misc]

        def bare(i: int) -> None:
            buffer = torch.zeros(1, dtype=torch.float64)
            buffer[0] += 1.0

        def best(fn) -> float:
            runs = []
            for _ in range(trials):
                started = time.perf_counter()
                for i in range(steps):
                    fn(i)
                runs.append((time.perf_counter() - started) / steps)
            return min(runs)

        cost = best(observed) - best(bare)
        metrics.close()
    return 1e6 * cost


def measure_overhead(
    nproc: int,
    repetitions: int,
    steps: int,
    out_dir: Path,
    model: str = "cnn",
    options: list[str] | None = None,
) -> dict:
    """Run the workers (as ranks of one job, without the launcher) and write the report files."""
    from loom.launch.spec import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="loom-overhead-") as tmp:
        result = Path(tmp) / "times.json"
        port = free_port()
        procs = []
        for rank in range(nproc):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1")  # fmt: skip
            env.pop("LOOM_RUN_DIR", None)
            cmd = [sys.executable, "-m", "loom_bench.metrics_overhead", "--worker", "--repetitions", str(repetitions),
                   "--steps", str(steps), "--model", model, "--result", str(result),
                   *(a for pair in options or [] for a in ("--option", pair))]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise RuntimeError(f"overhead workers exited with {codes}")
        times = json.loads(result.read_text())
    ratios = [on / off - 1 for on, off in zip(times["on"], times["off"], strict=True)]
    controls = [c / off - 1 for c, off in zip(times["control"], times["off"], strict=True)]
    direct = direct_cost_us(nproc)
    quartiles = statistics.quantiles(ratios, n=4)
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "model": MODELS[model],
        "command": f"python -m loom_bench.metrics_overhead --model {model} --nproc {nproc} --repetitions {repetitions} "
        f"--steps {steps}" + "".join(f" --option {pair}" for pair in options or []),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "nproc": nproc,
        "repetitions": repetitions,
        "steps": steps,
        "step_ms_on": [1e3 * t for t in times["on"]],
        "step_ms_off": [1e3 * t for t in times["off"]],
        "step_ms_control": [1e3 * t for t in times["control"]],
        "median_step_ms_on": 1e3 * statistics.median(times["on"]),
        "median_step_ms_off": 1e3 * statistics.median(times["off"]),
        "overhead_median": statistics.median(ratios),
        "overhead_per_repetition": ratios,
        "overhead_quartiles": [quartiles[0], quartiles[2]],
        "overhead_of_medians": statistics.median(times["on"]) / statistics.median(times["off"]) - 1,
        "control_median": statistics.median(controls),
        "control_per_repetition": controls,
        "direct_cost_us": direct,
        "direct_cost_share": direct / (1e6 * statistics.median(times["off"])),
    }
    stem = "metrics_overhead" if model == "cnn" else f"metrics_overhead_{model}"
    stem += "" if nproc == 2 else f"_n{nproc}"
    stem += "".join(f"_{pair.replace('=', '_')}" for pair in options or [])
    (out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    _plot(summary, out_dir / f"{stem}.png")
    (out_dir / f"{stem}.md").write_text(_markdown(summary, stem))
    return summary


def _plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [2, 1]})
    reps = range(1, s["repetitions"] + 1)
    left.plot(reps, s["step_ms_off"], "o-", label="metrics off")
    left.plot(reps, s["step_ms_on"], "s-", label="metrics on")
    left.plot(reps, s["step_ms_control"], "^:", label="metrics off (control job)")
    left.set_xlabel("repetition (on/off interleaved)")
    left.set_ylabel("median step time (ms)")
    left.set_ylim(bottom=0)
    left.legend()
    right.bar(["off", "on"], [s["median_step_ms_off"], s["median_step_ms_on"]], color=["#4c78a8", "#f28e2b"])
    right.set_title(
        f"paired median {100 * s['overhead_median']:+.1f} % (control {100 * s['control_median']:+.1f} %);"
        f"\ndirect cost {s['direct_cost_us']:.0f} µs = {100 * s['direct_cost_share']:.1f} %",
        fontsize=9,
    )
    right.set_ylabel("median step time (ms)")
    fig.suptitle(
        f"loom.observe overhead: {s['model'].split(',')[0]}, {s['nproc']} processes, {s['steps']} steps per repetition"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(s: dict, stem: str) -> str:
    return (
        "# Metrics overhead (loom.observe on vs off)\n\n"
        f"{s['date']}, {s['machine']}, load average {' / '.join(f'{v:.2f}' for v in s['load_before'])} before and "
        f"{' / '.join(f'{v:.2f}' for v in s['load_after'])} after; `{s['command']}`; {s['model']}, one thread per process, "
        f"{s['nproc']} processes, {s['repetitions']} interleaved repetitions of {s['steps']} steps.\n\n"
        "| | median step time |\n|---|---|\n"
        f"| metrics off | {s['median_step_ms_off']:.2f} ms |\n| metrics on | {s['median_step_ms_on']:.2f} ms |\n\n"
        f"End to end, median of the paired per-repetition overheads: **{100 * s['overhead_median']:+.2f} %** "
        f"(quartiles {100 * s['overhead_quartiles'][0]:+.1f} % .. {100 * s['overhead_quartiles'][1]:+.1f} %; "
        f"ratio of the medians {100 * s['overhead_of_medians']:+.2f} %). Per repetition: "
        + ", ".join(f"{100 * r:+.1f}" for r in s["overhead_per_repetition"])
        + " %.\n\n"
        f"Direct cost, the observer's own work per step on rank 0 measured alone (best of 5 x 3000 steps): "
        f"**{s['direct_cost_us']:.0f} µs = {100 * s['direct_cost_share']:.2f} %** of the median step without "
        "metrics.\n\n"
        f"Control (a second job with metrics off, its steps taking turns with the other two): "
        f"**{100 * s['control_median']:+.2f} %** against the first: the size of the differences that noise and "
        "the order of jobs alone produce in this run. Per repetition: "
        + ", ".join(f"{100 * r:+.1f}" for r in s["control_per_repetition"])
        + " %.\n\n"
        "Direct cost is measured in a tight loop, where Python's caches are warm; between two training steps the "
        "same calls took 2-4x longer (instrumented in a real run), so the end-to-end figure is the one to judge "
        "the 1 % budget by.\n\n"
        f"![step time on vs off]({stem}.png)\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="cnn")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=12)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports"))
    parser.add_argument(
        "--option", action="append", default=[], help="DataParallel's KEY=VALUE, e.g. overlap=True"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.model, args.repetitions, args.steps, args.result, _options(args.option))
        return 0
    s = measure_overhead(args.nproc, args.repetitions, args.steps, args.out, args.model, args.option)
    print(
        f"metrics on {s['median_step_ms_on']:.2f} ms/step, off {s['median_step_ms_off']:.2f} ms/step: end to end "
        f"{100 * s['overhead_median']:+.2f} % (median of {s['repetitions']} paired repetitions; control job "
        f"{100 * s['control_median']:+.2f} %); direct cost "
        f"{s['direct_cost_us']:.0f} µs/step = {100 * s['direct_cost_share']:.2f} %"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
