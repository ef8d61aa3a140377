"""``loom report`` on a real 2-process run directory; the HTML opened in headless Chromium when installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_workers

from loom.observe.report import run_report
from loom.observe.report_figures import FIGURES

CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_RUN_DIR", str(run_dir))
        mp.delenv("LOOM_TRACE_STEPS", raising=False)
        run_workers("observe_run.py", 2, str(run_dir.parent), "12", "plain", timeout=100)
    # Stand-in for `loom run -n 1 --run-dir RUN_DIR/baseline`: rank 0's records as a one-process baseline.
    (run_dir / "baseline/metrics").mkdir(parents=True)
    shutil.copy(run_dir / "metrics/rank0.jsonl", run_dir / "baseline/metrics/rank0.jsonl")
    assert run_report(run_dir) == 0
    return run_dir / "report"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_report_writes_html_with_every_chart_embedded_and_pngs(report_dir):
    page = (report_dir / "report.html").read_text()
    for name in FIGURES:
        assert (report_dir / f"{name}.png").stat().st_size > 1000
        assert f'id="chart-{name}"' in page
    assert page.count('src="data:image/png;base64,') == len(FIGURES)
    assert 'src="http' not in page and "<link" not in page  # self-contained
    summary = json.loads((report_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["scaling_efficiency"] == pytest.approx(0.5, rel=1e-6)  # same records: 1/N by definition
    assert [row["rank"] for row in summary["ranks"]] == [0, 1]
    # memory: steps 1 and 2 of each rank sampled by the job itself (DataParallel's whole model with its optimizer)
    assert [row["rank"] for row in summary["memory"]] == [0, 1]
    for row in summary["memory"]:
        assert row["sampled_steps"] == 2 and row["parameters_mb"] > 0 and row["gradients_mb"] > 0
        assert row["peak_rss_mb"] >= row["start_rss_mb"] > 0
    assert '<table id="memory">' in page and "peak RSS in step MiB" in page


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_report_of_a_directory_without_records_says_what_to_pass(tmp_path, capsys):
    assert run_report(tmp_path) == 2
    assert "HINT" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_report_loads_in_headless_chromium_without_script_errors(report_dir, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    url = (report_dir / "report.html").resolve().as_uri()
    flags = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
             f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=60).stdout
    root = re.search(r"<html[^>]*>", dom)
    assert root is not None, dom[:500]
    root_tag = root.group(0)  # the report's script writes its checks as attributes of <html>
    assert 'data-report-ready="1"' in root_tag, root_tag
    assert "data-script-error" not in root_tag, root_tag
    assert (
        f'data-charts-loaded="{len(FIGURES)}"' in root_tag
        and f'data-charts-total="{len(FIGURES)}"' in root_tag
    )
    shot = report_dir / "screenshot.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1100,1400", url], capture_output=True,
                   timeout=60, check=True)  # fmt: skip
    assert shot.stat().st_size > 10_000


NO_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # as if not installed: `import matplotlib` raises ImportError
from loom.cli import main
sys.exit(main(["report", sys.argv[1]]))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_directory_of_runs_gets_a_report_each_and_tables_without_matplotlib(report_dir, tmp_path):
    """`loom demo`'s layout (issue 36): RUN_DIR/distributed and RUN_DIR/single, no records of RUN_DIR's own."""
    demo = tmp_path / "demo"
    for name in ("distributed", "single"):
        shutil.copytree(report_dir.parent / "metrics", demo / name / "metrics")
    bare = subprocess.run([sys.executable, "-c", NO_MATPLOTLIB, str(demo)], capture_output=True, text=True,
                          timeout=100)  # fmt: skip
    assert bare.returncode == 0 and "Traceback" not in bare.stderr, bare.stdout + bare.stderr
    lines = bare.stdout.splitlines()
    assert lines[0].startswith(f"loom report: {demo} holds 2 runs (distributed and single)")
    assert lines[1:] == [f"loom report: wrote {demo / n / 'report/report.html'} with the tables; for the charts: "
                         "pip install 'loom-train[plot]'" for n in ("distributed", "single")]  # fmt: skip
    page = (demo / "single/report/report.html").read_text()
    assert "<h2>Summary</h2>" in page and "not drawn: matplotlib is not installed" in page
    assert run_report(demo) == 0  # with matplotlib: the figures
    assert len(list((demo / "distributed/report").glob("*.png"))) == len(FIGURES)
