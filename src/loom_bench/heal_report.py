"""The markdown (and JSON) report of `loom_bench.heal_compare`: medians side by side, then every kill's figures.

Kept apart from the harness so that the unit lane can render a report from hand-made records without starting a
process.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

ROWS = [
    ("survivors_next_commit_s", "(a) kill -> survivors' next committed step, s"),
    ("survivors_resumed_s", "(a*) kill -> survivors' first commit of a step begun after it, s"),
    ("survivor_steps_not_committed", "(c) survivors' attempts not committed (steps lost)"),
    ("stall_in_steps", "(c') (a*) in healthy steps"),
    ("replacement_first_commit_s", "(b) replacement start -> its first committed step, s"),
    ("replacement_first_commit_steps", "(b) ... in steps after its start"),
    ("replacement_first_contributing_s", "(b') replacement start -> first step with its gradients, s"),
    ("replacement_first_contributing_steps", "(b') ... in steps after its start"),
    ("kill_to_contributing_s", "(d) kill -> the replacement's first step with its gradients, s"),
    ("kill_to_contributing_steps", "(d) ... in steps after the kill"),
    ("replacement_ready_s", "replacement start -> ready (imports, init, setup), s"),
    ("replacement_ready_to_commit_s", "(b°) replacement ready -> first step with its gradients, s"),
    ("replacement_ready_to_commit_steps", "(b°) ... in steps after ready"),
]

DEFINITIONS = """\
How the figures are taken (`loom_bench.heal_records`): each worker appends a line per attempt at a step (step
number, committed or not, participants, whether its own gradients were in, pid, wall time) and a line when its
script starts (before torch is imported; under loom a replacement is forked from the launcher's zygote, which
imported torch before the kill, `loom.launch.zygote` (until 2026-11-26 11:30: a spare process, `loom.launch.spare`), so its script starts
when it takes the rank); the harness SIGKILLs replica R's process once it has committed step S
with every replica present, and writes the kill's time. (a) is the time from the kill to the last survivor's next
committed step, which can be the step in flight when the kill came after its exchange; (a*) the time to the last
survivor's first commit of a step begun after the kill (the stall the kill causes); (b) the time from the replacement's first line to its first committed step, and that step's
number less the job's committed steps when the replacement started (1 = the very next step); (b') the same to its
first committed step with its own gradients averaged in (torchft lets a replica commit the step it heals in
without contributing); (b°) the same from the replacement's `ready` line (imports, joining the job and the model's
setup done, just before its first step), so that start-up is told apart from joining; (d) the time from the kill
to the replacement's first committed step with its own gradients, whatever its process's start; (c) the most attempts one survivor made between the kill and (a*) that were not
committed; (c') (a*) divided by the median healthy step (consecutive committed steps at full membership), which
also counts a retry that a side does not report. Medians are over the kills that reached the figure (n)."""


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _started(results: dict[str, dict[str, Any]]) -> str:
    starts = [r["started"] for r in results.values() if "started" in r]
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(min(starts) if starts else time.time()))


TORCHFT_NOTES = """torchft is driven as its `train_ddp.py` example does on CPU (`loom_bench.heal_torchft_worker`): a lighthouse on
127.0.0.1, one `Manager` per replica group with `ProcessGroupGloo` (5 s timeout) and the default HTTP checkpoint
transport, its `DistributedDataParallel` and `OptimizerWrapper`; the harness starts each replacement at once.
When the lighthouse declares a replica dead is its `heartbeat_timeout_ms`; a quorum that lacks a heart-beating
replica waits for it up to `join_timeout_ms`; a survivor whose all-reduce failed stops exchanging, so another
survivor's all-reduce can wait gloo's timeout. torchft 0.2.0's DDP communication hook fails `assert fut._fut` in
`backward` when gloo's wait raises on a killed peer, which kills the survivors (`--torchft-ddp-hook original`
shows it); the worker's hook is torchft's with that error path completed (the error is reported to the Manager,
`should_commit` drops the step), as torchft documents the all-reduce to behave."""


def render(
    results: dict[str, dict[str, Any]], command: str, settings: dict[str, Any], notes: str = ""
) -> str:
    """The report; ``notes``: a reading of this run written after it (kept in the JSON, see `main`)."""
    sides = list(results)
    lines = [
        f"# Healing a killed worker: {' vs '.join(sides)}",
        "",
        f"Command: `{command}` ({_started(results)}; {platform.node()}, {platform.machine()}, {os.cpu_count()} "
        "CPUs; shared machine, see the load averages).",
        "",
        f"Model: MLP 784-{settings.get('hidden')}-{settings.get('hidden')}-10, SGD, {settings.get('batch')} "
        f"synthetic samples per replica per step; {settings.get('replicas')} replicas of one process each on "
        f"this host (CPU, gloo); kills `{settings.get('kills')}` (REPLICA@STEP), each landing at phase "
        f"`{settings.get('kill_phase')}` (seed {settings.get('seed')}) of the victim's next step; "
        f"each run ends {settings.get('tail_steps')} steps after its last replacement trains with all present "
        f"(at most {settings.get('steps')} steps).",
        "",
        "| median over kills | " + " | ".join(sides) + " |",
        "|---|" + "---|" * len(sides),
    ]
    for key, title in ROWS:
        cells = []
        for side in sides:
            median = results[side]["medians"].get(key, {"median": None, "n": 0})  # older reports lack some
            cells.append(f"{_fmt(median['median'])} (n={median['n']})")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    for label, key in (
        ("healthy step, s", "healthy_step_s"),
        ("steps committed", "steps_committed"),
        ("steps committed below full membership", "steps_below_full_membership"),
        ("wall time of the run, s", "wall_s"),
    ):
        lines.append(f"| {label} | " + " | ".join(_fmt(results[s].get(key)) for s in sides) + " |")
    lines.append(
        "| load average (1 min): before; at each kill; after | "
        + " | ".join(
            f"{results[s]['load']['before']:.2f}; {', '.join(f'{x:.2f}' for x in results[s]['load']['at_kills'])};"
            f" {results[s]['load']['after']:.2f}"
            for s in sides
        )
        + " |"
    )
    lines += ["", DEFINITIONS, ""]
    if "torchft" in results:
        lines += [TORCHFT_NOTES, ""]
    if notes:
        lines += ["## Reading this run (written after it)", "", notes.strip(), ""]
    for side in sides:
        result = results[side]
        described = ", ".join(f"{k}={v}" for k, v in result["side"].items() if k != "side")
        lines += [
            f"## {side}: each kill",
            "",
            f"Settings: {described}.",
            "",
            "| kill (replica@step, phase) | (a) s | participants at (a) | (a*) s | participants at (a*) | (c) | (c') "
            "| (b) s | (b) steps | (b') s | (b') steps |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in result["events"]:
            lines.append(
                f"| {e['replica']}@{e['kill_step']}, {e['kill_phase']:.2f} | {_fmt(e['survivors_next_commit_s'])} | "
                f"{_fmt(e['participants_at_next_commit'])} | {_fmt(e['survivors_resumed_s'])} | "
                f"{_fmt(e['participants_at_resumed'])} | {e['survivor_steps_not_committed']} | "
                f"{_fmt(e['stall_in_steps'])} | {_fmt(e['replacement_first_commit_s'])} | "
                f"{_fmt(e['replacement_first_commit_steps'])} | {_fmt(e['replacement_first_contributing_s'])} | "
                f"{_fmt(e['replacement_first_contributing_steps'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def write_report(
    out: Path, results: dict[str, dict[str, Any]], command: str, settings: dict[str, Any]
) -> tuple[Path, Path]:
    """``out`` (markdown) and the same figures as JSON beside it (``out`` with ``.json``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, command, settings) + "\n", encoding="utf-8")
    kept = {k: v for k, v in settings.items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    raw = {"command": command, "settings": kept, "results": results}
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(raw, indent=1, default=str) + "\n", encoding="utf-8")
    return out, json_path


def main(argv: list[str] | None = None) -> int:
    """``python -m loom_bench.heal_report REPORT.json [OUT.md]``: render a report again from its JSON (after
    adding a ``"notes"`` string to it, say)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m loom_bench.heal_report REPORT.json [OUT.md]")
    raw = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    out = Path(args[1]) if len(args) > 1 else Path(args[0]).with_suffix(".md")
    text = render(raw["results"], raw["command"], raw["settings"], raw.get("notes", ""))
    out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
