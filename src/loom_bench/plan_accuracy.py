"""``python -m loom_bench.plan_accuracy``: `loom plan`'s predictions against measured runs.

For each model size (the MLP chain of ``tests/workers/plan_tiny.py`` at a width and depth), `loom.plan.plan`
plans 2 processes; then every configuration of `CHOSEN` that the plan predicted runs a few steps under
``loom run`` (`loom.plan.planner.verify` on that one configuration), and its predicted and measured step time,
persistent state (parameters, gradients, optimizer state) and peak RSS (the largest rank's) are written side by
side, with the load average before and after each run. With ``--hosts H --link RATE`` (root) the plan is for H
hosts, one process each, and each configuration runs on H network namespaces joined by veth pairs shaped by
``tc tbf`` to RATE (`loom_bench.links`); parameter servers are left out there (that runner starts none).
Writes ``plan_accuracy[_Hhosts_RATE].md`` and ``.json`` into ``--out`` after every model (a run stopped early
keeps what it measured).

    PYTHONPATH=src python -m loom_bench.plan_accuracy [--out benchmarks/reports] [--steps 5] [--repeats 3]
        [--models small,medium,large] [--hosts 2 --link 100mbit] [--cgroup]

``--cgroup`` (root, one host) runs each configuration once more as a whole job (launcher, zygote, workers,
servers) in a memory cgroup of ``N x`` its predicted peak RSS per process (`loom_bench.plan_confined`): the
column says whether it ran to the end, and the group's peak charge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loom.plan.planner import PlanResult, Verification, plan, verify
from loom.plan.recommend import Ranked
from loom.plan.transport import parse_rate

__all__ = ["CHOSEN", "MODELS", "main"]

MODELS = {"small": ("--width", "64", "--depth", "4"), "medium": ("--width", "512", "--depth", "6"),
          "large": ("--width", "1536", "--depth", "6")}  # fmt: skip
CHOSEN = (
    'loom.DataParallel(allreduce="native")', 'loom.DataParallel(allreduce="ring")',
    'loom.DataParallel(allreduce="shm")', 'loom.DataParallel(compression="fp16")',
    'loom.DataParallel(compression="powersgd:4")', "loom.ShardedDataParallel(stage=1)",
    "loom.ShardedDataParallel(stage=3)", 'loom.ParameterServer(mode="sync")', "loom.LocalSGD(sync_every=8)",
    "loom.DiLoCo(sync_every=8)", 'loom.Pipeline(stages=2, microbatches=2, schedule="gpipe")',
    'loom.Pipeline(stages=2, microbatches=4, schedule="1f1b")', "loom.TensorParallel(size=2)",
    'loom.Hybrid(dp=2, pp=2, microbatches=2, schedule="gpipe")', "loom.TensorParallel(size=4)",
)  # fmt: skip
"""The configurations measured, where the plan has them (a hybrid and TensorParallel(size=4) with --nproc 4)."""
HOSTS_TIMEOUT_S = 600.0
SCRIPT = str(Path(__file__).resolve().parents[2] / "tests" / "workers" / "plan_tiny.py")


def _load() -> float:
    return os.getloadavg()[0]


def _verify_on_hosts(hosts: Any, r: Ranked, args: tuple[str, ...], steps: int) -> Verification:
    """``r``'s configuration run on namespace hosts (one process each, `loom_bench.links.run_job`), measured by
    `loom.plan.trial` as ``loom plan --verify`` measures on one host."""
    from loom_bench.links import run_job

    c = r.prediction.config
    with tempfile.TemporaryDirectory(prefix="loom-plan-hosts-") as tmp:
        out = Path(tmp) / "result.json"
        options = ["verify", "--out", str(out), "--family", c.family, "--options", json.dumps(dict(c.options)),
                   "--steps", str(steps), SCRIPT, *args]  # fmt: skip
        run_job(hosts, "loom.plan.trial", options, Path(tmp), HOSTS_TIMEOUT_S)
        got = json.loads(out.read_text())
    return Verification.of(r.prediction, got)


def _confined(r: Ranked, args: tuple[str, ...], steps: int, job_share: int) -> str:
    """``r``'s configuration run once as a whole job in a memory cgroup of the smallest memory its "fits" verdict
    allows (`loom_bench.plan_confined`): ``N x`` what it asks of ``--memory-per-proc`` (`needed_per_process`: the
    predicted peak, its share of the launcher's, the margin), ``N`` counting parameter servers as workers (their
    memory is not predicted): "ran", with the group's peak charge, or why it did not."""
    from loom.plan.recommend import needed_per_process
    from loom_bench.plan_confined import run_confined

    c = r.prediction.config
    with tempfile.TemporaryDirectory(prefix="loom-plan-confined-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "loom.cli", "run", "-n", str(c.nproc), "--run-dir", f"{tmp}/run"]
        command += ["--servers", str(c.servers)] if c.servers else []
        command += ["-m", "loom.plan.trial", "verify", "--out", str(out), "--family", c.family,
                    "--options", json.dumps(dict(c.options)), "--steps", str(steps), SCRIPT, *args]  # fmt: skip
        # the smallest a "fits" verdict allows: N x what it asks of --memory-per-proc
        limit = (c.nproc + c.servers) * needed_per_process(r.prediction, job_share)
        done, charged = run_confined(command, limit, HOSTS_TIMEOUT_S)
        if done.returncode == 0 and out.exists():
            return f"ran ({charged / 2**20:.0f} of {limit / 2**20:.0f} MiB)"
        return (
            f"failed under {limit / 2**20:.0f} MiB: "
            + " | ".join(done.stderr.strip().splitlines()[-3:-1])[:200]
        )


def _rows(
    result: PlanResult,
    args: tuple[str, ...],
    steps: int,
    repeats: int,
    hosts: Any = None,
    cgroup: bool = False,
) -> list[dict[str, Any]]:
    """Each chosen configuration measured ``repeats`` times, in passes over all of them (so a burst of load
    lands on one measurement of several configurations, not on every measurement of one); the row's measured
    step is the median of its measurements."""
    picked: list[Ranked] = []
    for strategy in CHOSEN:
        ranked = [r for r in result.ranked if r.prediction.config.strategy == strategy and r.feasible]
        picked += [r for r in ranked if r.prediction.config.servers in ((0,) if hosts else (0, 1))][:1]
    rows: list[dict[str, Any]] = [
        {"strategy": r.prediction.config.strategy, "launch": r.prediction.config.launch,
         "predicted_s": r.prediction.step_time_s, "measured_all": [], "loads": [],
         "rank_predicted": result.ranked.index(r) + 1} for r in picked
    ]  # fmt: skip
    for _ in range(repeats):
        for r, row in zip(picked, rows, strict=True):
            if "error" in row:
                continue
            before = _load()
            one = PlanResult(**{**result.__dict__, "ranked": [r]})
            try:
                v = (
                    _verify_on_hosts(hosts, r, args, steps)
                    if hosts
                    else verify(one, args, top=1, steps=steps)[0]
                )
            except Exception as error:  # noqa: BLE001 - a failed run is a row of the report, not the end of it
                row["error"] = str(error)[:300]
                continue
            row["measured_all"].append(v.measured_s)
            row["loads"].append([before, _load()])
            row.update(predicted_state=v.predicted_state, measured_state=v.measured_state,
                       predicted_peak=v.predicted_peak)  # fmt: skip
            row["measured_peak"] = max(row.get("measured_peak", 0), v.measured_peak)
            row["measured_s"] = statistics.median(row["measured_all"])
            row["step_error"] = row["predicted_s"] / row["measured_s"] - 1
            print(json.dumps(row), flush=True)
    for r, row in zip(picked, rows, strict=True):
        if cgroup and "error" not in row:
            row["confined"] = _confined(r, args, steps, result.job_share)
            print(json.dumps({"strategy": row["strategy"], "confined": row["confined"]}), flush=True)
    return rows


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-a of two rankings given as values (1: the same order, -1: reversed)."""
    pairs = [(i, j) for i in range(len(xs)) for j in range(i + 1, len(xs))]
    if not pairs:
        return 1.0
    signs = [((xs[i] > xs[j]) - (xs[i] < xs[j])) * ((ys[i] > ys[j]) - (ys[i] < ys[j])) for i, j in pairs]
    return sum(signs) / len(pairs)


def _peaks(rows: list[dict[str, Any]]) -> str:
    """How the predicted peak RSS compares with the measured (the largest process of each run)."""
    errs = [r["predicted_peak"] / r["measured_peak"] - 1 for r in rows if r.get("measured_peak")]
    if not errs:
        return ""
    under = sum(e < -0.05 for e in errs)
    confined = [r["confined"] for r in rows if "confined" in r]
    ran = (f" As whole jobs in a memory cgroup of N x what the fits verdict asks per process (`--cgroup`): "
           f"{sum(c.startswith('ran') for c in confined)} of {len(confined)} ran to the end." if confined else "")  # fmt: skip
    return (f" Peak RSS: median |error| {statistics.median(abs(e) for e in errs):.0%}, worst "
            f"{max(errs, key=abs):+.0%}; under-predicted by more than 5 % in {under} of {len(errs)}." + ran)  # fmt: skip


def _ranking(rows: list[dict[str, Any]]) -> str:
    """Kendall tau of predicted vs measured step times, and how far the predicted best is from the measured."""
    done = [r for r in rows if "measured_s" in r and "error" not in r]
    if len(done) < 2:
        return ""
    tau = kendall_tau([r["predicted_s"] for r in done], [r["measured_s"] for r in done])
    pick = min(done, key=lambda r: r["predicted_s"])
    best = min(r["measured_s"] for r in done)
    return (f"Ranking of these configurations by step time: Kendall tau {tau:.2f}; the predicted best, "
            f"`{pick['strategy']}`, measured {pick['measured_s'] / best - 1:+.0%} from the measured best.")  # fmt: skip


def _markdown(report: dict) -> str:
    lines = [
        "# `loom plan`: predicted vs measured, "
        + (
            f"one host, {report.get('nproc', 2)} processes"
            if report.get("hosts", 1) == 1
            else f"{report['hosts']} namespace hosts at {report['link']} (veth + tc tbf), one process each"
        ),
        "",
        f"Command: `{report['command']}` ({report['date']}, {report['machine']}). Model: the MLP chain of "
        "`tests/workers/plan_tiny.py` (Adam, global batch 64), at three sizes. Step time: the median of "
        f"{report['steps']} timed blocks (a sync round for LocalSGD/DiLoCo, else one step; each the slowest "
        f"rank's) after 2 warm-up steps, under `loom run`, in each of {report.get('repeats', 1)} runs; the "
        "median run is the measured step. State: "
        "parameters + gradients + optimizer state of the largest rank, counted by `job.memory()`. Error: "
        "predicted / measured - 1.",
        "",
    ]
    for name, model in report["models"].items():
        errs = [abs(r["step_error"]) for r in model["rows"] if "step_error" in r]
        lines += [f"## {name} ({model['params']:,} parameters, {model['args']})", "",
                  f"Plan: {model['plan_seconds']}; measured engine overhead per step {model['overhead_s'] * 1e3:.1f} ms"
                  f" (pipelines {model.get('pipeline_overhead_s', model['overhead_s']) * 1e3:.1f} ms),"
                  f" overlap coefficient {model['overlap']:.2f} (DDP's extra"
                  f" {model.get('ddp_extra_s', 0.0) * 1e3:.1f} ms). Step-time |error|: median "
                  f"{statistics.median(errs):.0%}, mean {statistics.mean(errs):.0%}, worst {max(errs):.0%} "
                  f"({len(errs)} configurations). " + _ranking(model["rows"]) + _peaks(model["rows"]) if errs else "",
                  "",
                  "| configuration | loom run | predicted ms | measured ms | error | state predicted | state measured "
                  "| peak predicted MiB | peak measured MiB | runs (ms) | load before/after | a cgroup of N x the "
                  "verdict's need |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]  # fmt: skip
        for r in model["rows"]:
            if "error" in r:
                lines.append(
                    f"| `{r['strategy']}` | {r['launch']} | | | failed: {r['error']} | | | | | | | |"
                )
                continue
            lines.append(
                f"| `{r['strategy']}` | {r['launch']} | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} "
                f"| {r['step_error']:+.0%} | {r['predicted_state']:,} | {r['measured_state']:,} "
                f"| {r['predicted_peak'] / 2**20:.0f} | {r['measured_peak'] / 2**20:.0f} "
                f"| {', '.join(f'{x * 1e3:.1f}' for x in r['measured_all'])} "
                f"| {', '.join(f'{a:.1f}/{b:.1f}' for a, b in r['loads'])} | {r.get('confined', 'not run')} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loom_bench.plan_accuracy")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration (median kept)")
    parser.add_argument("--hosts", type=int, default=1, help="namespace hosts, one process each (needs root)")
    parser.add_argument("--link", default=None, help="their link rate, as tc writes it (with --hosts)")
    parser.add_argument("--nproc", type=int, default=2, help="processes planned on this host (one host)")
    parser.add_argument("--cgroup", action="store_true",
                        help="also run each configuration once in a memory cgroup of N x its predicted peak (root)")  # fmt: skip
    ns = parser.parse_args(argv)
    if (ns.hosts > 1) != (ns.link is not None):
        parser.error("--hosts H (2 or more) and --link RATE go together")
    if ns.cgroup and ns.hosts > 1:
        parser.error("--cgroup runs on this host only; drop --hosts, or drop --cgroup")
    given = sys.argv[1:] if argv is None else argv
    report: dict = {"command": "PYTHONPATH=src python -m loom_bench.plan_accuracy " + " ".join(given),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": ns.steps,
                    "repeats": ns.repeats, "machine": f"{os.cpu_count()} cores", "hosts": ns.hosts,
                    "link": ns.link, "nproc": ns.nproc, "models": {}}  # fmt: skip
    hosts = None
    if ns.hosts > 1:
        from loom_bench.links import Hosts, skip_reason

        reason = skip_reason()
        if reason:
            print(f"loom_bench.plan_accuracy: skipped: {reason}")
            return 0
        hosts = Hosts(ns.hosts)
    try:
        if hosts is not None:
            hosts.limit(ns.link)
        stem = "plan_accuracy" if hosts is None else f"plan_accuracy_{ns.hosts}hosts_{ns.link}"
        stem += f"_n{ns.nproc}" if hosts is None and ns.nproc != 2 else ""
        for name in ns.models.split(","):
            args = MODELS[name]
            nproc, rate = (ns.nproc, None) if hosts is None else (1, parse_rate(ns.link))
            result = plan(SCRIPT, args, nproc=nproc, hosts=ns.hosts, link_bytes_per_s=rate)
            seconds = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
            print(f"{name}: planned ({seconds})", flush=True)
            report["models"][name] = {
                "args": " ".join(args), "params": result.profile.param_count, "plan_seconds": seconds,
                "overhead_s": result.overhead_s, "pipeline_overhead_s": result.pipeline_overhead_s, "overlap": result.transport.overlap,
                "ddp_extra_s": result.transport.ddp_extra_s,
                "transport": result.transport.to_json(),  # what each prediction was made of
                "rows": _rows(result, args, ns.steps, ns.repeats, hosts, ns.cgroup),
            }  # fmt: skip
            ns.out.mkdir(parents=True, exist_ok=True)
            (ns.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
            (ns.out / f"{stem}.md").write_text(_markdown(report))
    finally:
        if hosts is not None:
            hosts.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
