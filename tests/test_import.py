"""Importing loom has no side effects, needs neither plotting nor the demo's data set, and loads no benchmark."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.multiprocess


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.timeout(90)
def test_importing_loom_changes_no_global_state_and_loads_no_benchmark():
    result = run_python(
        """
        import atexit, sys, signal, torch, torch.distributed
        hook, handlers = sys.excepthook, {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        at_exit = atexit._ncallbacks()
        import loom, loom.train.fit, loom.observe.report, loom.examples.char_gpt, loom.comm.ddp_async
        assert sys.excepthook is hook, sys.excepthook
        assert {s: signal.getsignal(s) for s in handlers} == handlers
        assert atexit._ncallbacks() == at_exit, "an import registered an exit handler"
        def benchmarks():
            return sorted(m for m in sys.modules if m.split(".")[0] == "loom_bench" or m.startswith("loom.bench"))
        assert not benchmarks(), benchmarks()
        import loom_bench  # the check itself: it sees the benchmarks once they are imported
        assert "loom_bench" in benchmarks(), benchmarks()
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.timeout(90)
def test_loom_trains_without_the_optional_extras_and_names_them_where_needed(tmp_path):
    result = run_python(
        f"""
        import sys
        sys.modules["matplotlib"] = None  # as if not installed: importing it raises ImportError
        sys.modules["sklearn"] = None
        import torch, loom
        from torch import nn
        model = nn.Linear(4, 2)
        records = "{tmp_path}/metrics/rank0.jsonl"  # what `loom report` reads
        strategy = loom.DataParallel(metrics_path=records)
        job = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)
        data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
        assert loom.fit(job, job.loader(data, 4), steps=2, progress=False).steps == 2
        job.metrics.close()
        try:
            __import__('loom.demo.train', fromlist=['x']).digits_datasets()
        except ImportError as error:
            assert "loom-train[demo]" in str(error), error
        else:
            raise AssertionError("the demo's data set without scikit-learn")
        # The report without matplotlib: the tables, and one line naming the extra for the charts.
        page = __import__('loom.observe.report', fromlist=['x']).write_report({str(tmp_path)!r})
        assert "loom-train[plot]" in page.read_text(), "the page names the extra for the charts"
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "ok", result.stderr[-2000:]
