"""``loom plan``: its arguments, and the run that prints the ranked table (`loom.cli` registers it)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_plan_parser", "parse_bytes", "run_plan"]

_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``8GiB``, ``512MiB``, ``2GB``, ``1000000`` as a number of bytes (> 0)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _BYTES or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a memory size such as 8GiB, 512MiB or 2GB, got {text!r}. HINT: a positive number and one of "
            "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
        )
    return int(float(match.group(1)) * _BYTES[unit])


def _rate(text: str) -> float:
    from loom.plan.transport import parse_rate

    try:
        return parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_plan_parser(sub: Any, positive_int: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="which strategy should you choose: predicted step time and memory of every configuration",
        description="Run SCRIPT (a loom training script) up to its job.loader(...), measure its model for a few "
        "steps and the transport of N processes, predict the step time, samples/s, memory per process and bytes "
        "on the wire of every strategy configuration, and rank them (see docs/plan.md).",
    )
    p.add_argument("-n", "--nproc", type=positive_int, default=2, help="processes per host (default 2)")
    p.add_argument("--hosts", type=positive_int, default=1, help="hosts (default 1); several need --link")
    p.add_argument("--link", type=_rate, default=None, metavar="RATE",
                   help="the link rate between hosts, as tc writes it (100mbit, 1gbit)")  # fmt: skip
    p.add_argument("--memory-per-proc", type=parse_bytes, default=None, metavar="SIZE",
                   help="rule out configurations needing more per process (e.g. 8GiB)")  # fmt: skip
    p.add_argument("--verify", action="store_true", help="run the top configurations a few steps each under "
                   "loom run and print predicted vs measured")  # fmt: skip
    p.add_argument(
        "--verify-top", type=positive_int, default=2, metavar="K", help="configurations --verify runs"
    )
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per --verify run (default 5)")
    p.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write every configuration, ranked"
    )
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _refuse(ns: argparse.Namespace) -> str | None:
    if ns.link is not None and ns.hosts == 1:
        return "--link is the rate between hosts: it needs --hosts 2 or more. HINT: add --hosts H, or drop --link"
    if ns.hosts > 1 and ns.link is None:
        return "--hosts H needs the rate of the link between them. HINT: add --link 1gbit (or 100mbit, ...)"
    return None


def run_plan(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from loom.plan.capture import ScriptCaptureError
    from loom.plan.planner import PlanError, plan, verify
    from loom.plan.recommend import render, to_json

    refusal = _refuse(ns)
    if refusal:
        print(f"loom plan: {refusal}", file=sys.stderr)
        return 2
    args = tuple(a for a in ns.args if a != "--")
    script = shlex.join([ns.script, *args])  # as the shell takes it back, the script's own arguments with it
    console = Console(width=200)
    try:
        result = plan(ns.script, args, ns.nproc, ns.hosts, ns.link, ns.memory_per_proc)
        console.print(render(result.ranked, f"loom plan {script}: {ns.nproc * ns.hosts} processes, global batch "
                                            f"{result.global_batch_size}"))  # fmt: skip
        top = result.top.prediction.config
        print(f"\nchosen: {result.top.reason}\n  strategy = {top.strategy}\n  loom run {top.launch} {script}")
        verified = verify(result, args, ns.verify_top, ns.steps) if ns.verify else []
    except (ScriptCaptureError, PlanError) as error:
        text = str(error)
        print(text if text.startswith("loom plan") else f"loom plan: {text}", file=sys.stderr)
        return 2
    for v in verified:
        print(f"verify {v.config.name}: step {v.predicted_s * 1e3:.1f} ms predicted, {v.measured_s * 1e3:.1f} ms "
              f"measured ({v.error:+.1%}); state {v.predicted_state} B predicted, {v.measured_state} B measured; "
              f"peak RSS {v.predicted_peak} B predicted, {v.measured_peak} B measured")  # fmt: skip
    if ns.json is not None:
        extra = {"script": ns.script, "nproc": ns.nproc, "hosts": ns.hosts, "link_bytes_per_s": ns.link,
                 "global_batch_size": result.global_batch_size, "overlap": result.transport.overlap,
                 "ddp_extra_s": result.transport.ddp_extra_s,
                 "seconds": result.seconds, "transport": result.transport.to_json(),
                 "verified": [{"strategy": v.config.strategy, "launch": v.config.launch, "predicted_s": v.predicted_s,
                               "measured_s": v.measured_s, "error": v.error, "predicted_state_bytes": v.predicted_state,
                               "measured_state_bytes": v.measured_state, "predicted_peak_bytes": v.predicted_peak,
                               "measured_peak_bytes": v.measured_peak} for v in verified]}  # fmt: skip
        ns.json.write_text(json.dumps(to_json(result.ranked, extra), indent=1))
    return 0
