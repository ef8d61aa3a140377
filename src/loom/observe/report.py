"""``loom report RUN_DIR``: one self-contained HTML file and PNG figures from a run's per-step records.

Reads ``RUN_DIR/metrics/rank<r>.jsonl`` (`loom.observe.metrics`), draws the figures of
`loom.observe.report_figures` into ``RUN_DIR/report/`` and writes ``RUN_DIR/report/report.html`` with the PNGs
embedded as base64, so it opens offline, from a mail attachment, with no server. It also merges a traced run's
per-rank traces into ``RUN_DIR/trace.json`` and lists the straggler warnings rank 0 raised.

Summary figures, all excluding the first (warm-up) step:

- *samples/s*: global samples over rank 0's summed step time.
- *scaling efficiency*: when a one-process run of the same script is in ``RUN_DIR/baseline`` (run it with
  ``loom run -n 1 --run-dir RUN_DIR/baseline ...``), ``samples/s / (world size x baseline samples/s)``.
- *time lost waiting*: per rank, the time blocked in communication (``comm_s``), absolute and as a share of
  the step time; in synchronous training mostly one rank waiting for the slowest.
- *memory*, per rank, from the sampled steps (`loom.observe.memory`): the training state by category after the
  last one, and the highest RSS peak during a step beside that step's starting RSS (their difference is what the
  step itself added: activations, gathered parameters, buffers).
"""

from __future__ import annotations

import base64
import html
import json
import re
import sys
from pathlib import Path
from typing import Any

from loom.observe.trace import merge_traces

__all__ = ["load_records", "record_files", "run_report", "summarize"]

_RECORD_FILE = re.compile(r"rank(\d+)(?:\.heal(\d+))?\.jsonl")


def load_records(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """``{rank: [record, ...]}`` from ``RUN_DIR/metrics/rank<r>.jsonl``, sorted by step (last write of a step wins:
    a resumed job re-runs steps after its checkpoint, a sampled step's memory rewrites its record). A healed
    rank's replacements (``rank<r>.heal<g>.jsonl``, `loom.parallel._setup.step_metrics`) continue its
    series, read after it in generation order; lines that are not whole records are skipped."""
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, _, path in record_files(Path(run_dir) / "metrics"):
        by_step = by_rank.setdefault(rank, {})
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line torn by a machine crash (a killed process leaves none), or blank
                continue
            if isinstance(record, dict) and "step" in record:
                by_step[record["step"]] = record
    return {
        rank: [by_step[s] for s in sorted(by_step)] for rank, by_step in sorted(by_rank.items()) if by_step
    }


def record_files(metrics_dir: str | Path) -> list[tuple[int, int, Path]]:
    """``(rank, generation, path)`` of each step-record file in ``metrics_dir``, sorted: ``rank<r>.jsonl`` is
    generation 0, a healed rank's replacements write ``rank<r>.heal<g>.jsonl`` (`loom.parallel._setup.step_metrics`)."""
    found = ((_RECORD_FILE.fullmatch(path.name), path) for path in Path(metrics_dir).glob("rank*.jsonl"))
    return sorted((int(match[1]), int(match[2] or 0), path) for match, path in found if match)


def _samples_per_s(records: list[dict[str, Any]]) -> float:
    recs = records[1:] or records
    elapsed = sum(r["time_s"] for r in recs)
    return sum(r["global_samples"] for r in recs) / elapsed if elapsed else 0.0


def summarize(
    runs: dict[int, list[dict[str, Any]]], baseline: dict[int, list[dict[str, Any]]] | None
) -> dict:
    """Job-wide figures and one row per rank (see the module docstring for the definitions)."""
    main = runs[min(runs)]
    rate = _samples_per_s(main)
    summary: dict[str, Any] = {
        "world_size": len(runs),
        "steps": len(main),
        "samples_per_s": rate,
        "final_loss": main[-1]["loss"],
        "scaling_efficiency": None,
        "baseline_samples_per_s": None,
    }
    if baseline:
        one = _samples_per_s(baseline[min(baseline)])
        summary["baseline_samples_per_s"] = one
        summary["scaling_efficiency"] = rate / (len(runs) * one) if one else None
    rows = []
    for rank, recs in runs.items():
        timed = recs[1:] or recs
        total = sum(r["time_s"] for r in timed)
        waiting = sum(r.get("comm_s") or 0.0 for r in timed)
        rows.append({
            "rank": rank,
            "steps": len(recs),
            "mean_step_ms": 1e3 * total / len(timed),
            **{f"{p}_ms": 1e3 * sum(r.get(f"{p}_s") or 0.0 for r in timed) / len(timed)
               for p in ("data", "compute", "comm", "optimizer")},
            "waiting_s": waiting,
            "waiting_share": waiting / total if total else 0.0,
            "mb_sent": sum(r.get("bytes_sent") or 0 for r in recs) / 1e6,
            "last_spread": next((r["spread"] for r in reversed(recs) if r.get("spread") is not None), None),
        })  # fmt: skip
    summary["ranks"] = rows
    summary["memory"] = [row for rank, recs in runs.items() if (row := _memory_row(rank, recs)) is not None]
    summary["time_lost_waiting_s"] = sum(r["waiting_s"] for r in rows)
    return summary


def _memory_row(rank: int, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Rank ``rank``'s memory: the last sampled state by category, the highest step peak and its step."""
    sampled = [r for r in records if r.get("memory")]
    if not sampled:
        return None
    row: dict[str, Any] = {"rank": rank, "sampled_steps": len(sampled)}
    row.update({f"{c}_mb": sampled[-1]["memory"].get(c, 0) / 2**20 for c in _STATE})
    peaks = [r for r in sampled if r.get("peak_rss_bytes") is not None]
    top = max(peaks, key=lambda r: r["peak_rss_bytes"]) if peaks else None
    row["peak_step"] = top["step"] if top else None
    row["peak_rss_mb"] = top["peak_rss_bytes"] / 2**20 if top else None
    start = top.get("rss_bytes") if top else None
    row["start_rss_mb"] = start / 2**20 if start is not None else None
    row["step_rise_mb"] = (top["peak_rss_bytes"] - start) / 2**20 if top and start is not None else None
    return row


_STATE = ("parameters", "gradients", "optimizer", "state")
_MEMORY_COLUMNS = [
    ("rank", "rank"),
    ("parameters_mb", "parameters MiB"),
    ("gradients_mb", "gradients MiB"),
    ("optimizer_mb", "optimizer MiB"),
    ("state_mb", "training state MiB"),
    ("peak_step", "peak at step"),
    ("start_rss_mb", "RSS at step start MiB"),
    ("peak_rss_mb", "peak RSS in step MiB"),
    ("step_rise_mb", "step's rise MiB"),
    ("sampled_steps", "sampled steps"),
]


def _memory_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return (
            "<p>no memory samples in the records (a job with memory_every=0, or a strategy without them)</p>"
        )
    return _table("memory", _MEMORY_COLUMNS, rows)


def _table(table_id: str, columns: list[tuple[str, str]], rows: list[dict[str, Any]]) -> str:
    """An HTML table of ``rows``: one column per ``(key, label)`` of ``columns``, cells formatted by `_cell`."""
    header = "".join(f"<th>{html.escape(label)}</th>" for _, label in columns)
    cells = ("".join(f"<td>{_cell(c, row[c])}</td>" for c, _ in columns) for row in rows)
    body = "".join(f"<tr>{row}</tr>" for row in cells)
    return f'<table id="{table_id}"><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>'


def _png_tag(name: str, title: str, path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    title = html.escape(title)
    return (f'<figure><img class="chart" id="chart-{name}" alt="{title}" '
            f'src="data:image/png;base64,{data}"></figure>')  # fmt: skip


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _summary_table(s: dict[str, Any]) -> str:
    eff = s["scaling_efficiency"]
    head = [
        ("processes", str(s["world_size"])),
        ("steps", str(s["steps"])),
        ("samples/s", _fmt(s["samples_per_s"], ",.1f")),
        ("one-process baseline samples/s", _fmt(s["baseline_samples_per_s"], ",.1f")),
        ("scaling efficiency", "n/a (no RUN_DIR/baseline)" if eff is None else f"{100 * eff:.1f} %"),
        ("time lost waiting (all ranks)", f"{s['time_lost_waiting_s']:.2f} s"),
        ("final loss", f"{s['final_loss']:.4f}"),
    ]
    job = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in head)
    columns = [("rank", "rank"), ("steps", "steps"), ("mean_step_ms", "step ms"), ("data_ms", "data ms"),
               ("compute_ms", "compute ms"), ("comm_ms", "comm ms"), ("optimizer_ms", "optimizer ms"),
               ("waiting_share", "waiting"), ("mb_sent", "MB sent")]  # fmt: skip
    if any(row.get("last_spread") is not None for row in s["ranks"]):  # gossip: how far replicas drifted
        columns.append(("last_spread", "spread (last)"))
    return f'<table id="summary">{job}</table><h2>Per rank</h2>' + _table("ranks", columns, s["ranks"])


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if column == "waiting_share":
        return f"{100 * value:.1f} %"
    if column == "last_spread":
        return f"{value:.3g}"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>loom report: {title}</title>
<script>
window.addEventListener("error", function (e) {{
  document.documentElement.setAttribute("data-script-error", String(e.message || e));
}});
</script>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; padding: 0 1.5em; max-width: 1500px; color: #222; }}
#charts {{ display: grid; grid-template-columns: repeat(auto-fit, minmax(620px, 1fr)); gap: 0 1.5em; }}
table {{ border-collapse: collapse; margin: .5em 0 1em; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f3f3f3; text-align: left; }}
figure {{ margin: .5em 0; }} img.chart {{ max-width: 100%; }}
.warn {{ color: #a33; }} #status {{ color: #777; font-size: 12px; }}
</style></head><body>
<h1>loom report</h1><p>Run directory: <code>{title}</code></p>
<h2>Summary</h2>{table}
<h2>Memory per rank</h2>{memory}
<h2>Straggler warnings</h2>{warnings}
<h2>Charts</h2><div id="charts">
{figures}
</div>
<p id="status">loading&hellip;</p>
<script>
(function () {{
  var charts = document.querySelectorAll("img.chart");
  var loaded = 0;
  charts.forEach(function (img) {{ if (img.complete && img.naturalWidth > 0) loaded += 1; }});
  var root = document.documentElement;
  root.setAttribute("data-charts-total", String(charts.length));
  root.setAttribute("data-charts-loaded", String(loaded));
  root.setAttribute("data-report-ready", "1");
  document.getElementById("status").textContent = loaded + " of " + charts.length + " charts loaded";
}})();
</script>
</body></html>
"""


def _warnings_html(run_dir: Path) -> str:
    path = run_dir / "metrics" / "stragglers.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    if not lines:
        return "<p>none</p>"
    items = [f'<li class="warn">step {w["step"]}: rank {w["rank"]} slow in <b>{html.escape(w["phase"])}</b> '
             f'({1e3 * w["rank_s"]:.1f} ms vs median {1e3 * w["median_s"]:.1f} ms)</li>'
             for w in map(json.loads, lines)]  # fmt: skip
    return "<ul>" + "".join(items) + "</ul>"


PLOT_HINT = "pip install 'loom-train[plot]'"
"""How to get the charts when matplotlib is missing (the library trains without it)."""


def _no_records(run_dir: Path) -> str:
    return (f"no step records in {run_dir / 'metrics'}. HINT: pass the --run-dir of a `loom run` job "
            "whose script trained with a loom strategy")  # fmt: skip


def write_report(run_dir: str | Path) -> Path:
    """Draw the figures and write ``RUN_DIR/report/report.html``; returns its path. Without matplotlib (an
    optional extra) the page has the tables and says how to get the charts."""
    return _write(Path(run_dir))[0]


def _write(run_dir: Path) -> tuple[Path, int]:
    """`write_report`, and how many figures it drew (0: matplotlib is not installed)."""
    runs = load_records(run_dir)
    if not runs:
        raise FileNotFoundError(_no_records(run_dir))
    baseline = load_records(run_dir / "baseline") or None
    summary = summarize(runs, baseline)
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    try:  # matplotlib is an optional extra: the library trains without it
        from loom.observe.report_figures import FIGURES, draw_figures
    except ImportError:
        pngs: dict[str, Path] = {}
        figures = f"<p>not drawn: matplotlib is not installed. HINT: {html.escape(PLOT_HINT)}</p>"
    else:
        pngs = draw_figures(runs, out)
        figures = "\n".join(_png_tag(name, FIGURES[name], path) for name, path in pngs.items())
    merge_traces(run_dir)
    page = _PAGE.format(
        title=html.escape(str(run_dir)),
        table=_summary_table(summary),
        memory=_memory_table(summary["memory"]),
        warnings=_warnings_html(run_dir),
        figures=figures,
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    path = out / "report.html"
    path.write_text(page)
    return path, len(pngs)


def _runs_below(run_dir: Path) -> list[Path]:
    """The subdirectories of ``run_dir`` that hold step records (``loom demo`` writes ``distributed`` and
    ``single``; a ``baseline`` beside a run belongs to that run)."""
    if not run_dir.is_dir():
        return []
    below = (d for d in sorted(run_dir.iterdir()) if d.is_dir() and d.name != "baseline")
    return [d for d in below if any(d.glob("metrics/rank*.jsonl"))]


def run_report(run_dir: Path) -> int:
    """Entry point of ``loom report RUN_DIR``: 0 on success, 2 with a message when there is nothing to report.
    A directory whose runs are in subdirectories (``loom demo``'s) gets one report per run, each named."""
    run_dir = Path(run_dir)
    targets = [run_dir] if load_records(run_dir) else _runs_below(run_dir)
    if not targets:
        print(f"loom report: {_no_records(run_dir)}", file=sys.stderr)
        return 2
    if targets != [run_dir]:
        names = " and ".join(d.name for d in targets)
        print(f"loom report: {run_dir} holds {len(targets)} runs ({names}); a report for each "
              f"(one alone: loom report {targets[0]})")  # fmt: skip
    for target in targets:
        path, drawn = _write(target)
        if drawn:
            print(f"loom report: wrote {path} and {drawn} figures in {path.parent}")
        else:
            print(f"loom report: wrote {path} with the tables; for the charts: {PLOT_HINT}")
    return 0
