"""One table of every ``loom bench dp`` report in a directory: ``python -m loom_bench.dp_matrix DIR [--skipped F]``.

The many-core run (``benchmarks/device/dp_matrix.sh``) writes one ``dp_vs_ddp_<model>_n<N>.json`` per cell; this
prints a Markdown table with a row per model and width: the medians, the paired ratios to raw DDP with loom's
defaults and with ``observe=False``, what observing costs, and the scaling efficiency, next to the host and the
load each cell ran under. ``--skipped``: a file listing the cells that did not run (one line each, with why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loom_bench.dp_worker import MODELS

__all__ = ["matrix_markdown"]


def matrix_markdown(reports: list[dict], skipped: list[str]) -> str:
    """The table of ``reports`` (`loom_bench.data_parallel.summarize`'s dicts), sorted by model then width."""
    order = list(MODELS)
    reports = sorted(reports, key=lambda r: (order.index(r["model_size"]), r["workers"]))
    lines = ["# loom DataParallel vs raw DDP: the matrix", ""]
    if reports:
        host = reports[0]["host"]
        lines += [
            f"Host: {host['machine']}, {host['cores']} cores, torch {host['torch']}, Python {host['python']}; "
            f"first cell {reports[0]['date']}. Each cell is one `loom bench dp` run (its command below); within "
            "it every repetition times loom, loom `observe=False`, raw DDP and one process in turn. Ratios are "
            "medians of per-repetition (paired) ratios.",
            "",
            "| model | workers | reps x steps | loom | observe=False | DDP | one process | loom / DDP | "
            "observe=False / DDP | observe cost | scaling (loom / DDP) | load before / after |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
    for r in reports:
        med, paired, eff = r["median_samples_per_s"], r["paired"], r.get("scaling_efficiency_paired", {})
        one = f"{med['one_process']:.0f}" if "one_process" in med else "-"
        scaling = f"{eff['loom']:.2f} / {eff['ddp']:.2f}" if eff else "-"
        load = " / ".join(f"{(v or [0])[0]:.1f}" for v in (r.get("load_before"), r.get("load_after")))
        lines.append(
            f"| {r['model_size']} | {r['workers']} | {r['repetitions']} x {r['steps_per_repetition']} | "
            f"{med['loom']:.0f} | {med['loom_unobserved']:.0f} | {med['ddp']:.0f} | {one} | "
            f"**{paired['loom_over_ddp']:.3f}** | {paired['loom_unobserved_over_ddp']:.3f} | "
            f"{100 * (1 - paired['loom_over_loom_unobserved']):+.2f} % | {scaling} | {load} |"
        )
    if skipped:
        lines += ["", "Cells not run (the time bound, or an error):", ""] + [f"- {line}" for line in skipped]
    lines += ["", "Commands:", ""] + [f"- `{r['command']}`" for r in reports]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--skipped", type=Path, default=None)
    ns = parser.parse_args(argv)
    reports = [json.loads(p.read_text()) for p in sorted(ns.dir.glob("dp_vs_ddp_*_n*.json"))]
    skipped = ns.skipped.read_text().splitlines() if ns.skipped is not None and ns.skipped.exists() else []
    sys.stdout.write(matrix_markdown(reports, [s for s in skipped if s.strip()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
