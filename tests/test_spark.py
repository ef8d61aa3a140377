"""loom on Spark: `loom.spark.run` on barrier tasks and on the driver, and a loom script under TorchDistributor.

One ``local[2]`` session for the module (UI off, driver on 127.0.0.1), stopped afterwards with its JVM.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pyspark")

import loom
import loom.spark  # noqa: E402

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))  # spark_train (pickled by reference) and common, here and in every worker
from common import reference_run  # noqa: E402
from spark_train import train  # noqa: E402
from test_launcher import wait_until_gone  # noqa: E402

pytestmark = pytest.mark.system

STEPS = 5


@pytest.fixture(scope="module")
def spark():
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "PYSPARK_PYTHON")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(WORKERS), saved["PYTHONPATH"]) if p)
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the Python workers' interpreter, which must have loom
    session = (
        SparkSession.builder.master("local[2]")
        .appName("loom-test-spark")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    jvm = session.sparkContext._gateway.proc
    try:
        yield session
    finally:
        session.stop()
        SparkContext._gateway.shutdown()
        SparkContext._gateway = SparkContext._jvm = None
        jvm.stdin.close()  # the JVM exits when its stdin closes (as at the end of a PySpark program)
        try:
            jvm.wait(timeout=20)
        except Exception:
            jvm.kill()
            jvm.wait()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        assert jvm.returncode is not None


def _check_against_one_process(result: dict) -> None:
    losses, params = reference_run("sgd", 8, STEPS)
    assert result["world_size"] == 2
    assert result["losses"] == pytest.approx(losses, abs=1e-5)
    for name, value in params.items():
        torch.testing.assert_close(torch.tensor(result["params"][name]), value.flatten(), atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_barrier_tasks_train_data_parallel_equal_to_one_process(spark):
    result = loom.spark.run(train, "dp", STEPS, num_processes=2, local_mode=False, spark=spark)
    _check_against_one_process(result)
    first, second = result["secrets"]
    assert first["hash"] == second["hash"] != "00" * 32, "every rank holds the same job secret"
    assert not first["in_proc"] and not second["in_proc"], (
        "the secret is in no command line or initial environment"
    )


@pytest.mark.timeout(120)
def test_a_failing_script_fails_the_run_naming_the_rank_and_leaves_no_worker(spark, tmp_path):
    with pytest.raises(
        Exception, match=r"rank 1's worker failed with exit status 1(.|\n)*rank 1 fails on purpose"
    ):
        loom.spark.run(
            str(WORKERS / "spark_train.py"), "fail", STEPS, tmp_path, num_processes=2, local_mode=False
        )
    assert wait_until_gone("--secret-on-stdin", timeout=20) == []  # rank 0's worker went with its task


@pytest.mark.timeout(120)
def test_local_mode_runs_the_function_under_loom_run_on_the_driver(spark):
    _check_against_one_process(loom.spark.run(train, "dp", STEPS, num_processes=2))


@pytest.mark.timeout(120)
def test_the_readme_script_under_torch_distributor_equals_one_process(spark, tmp_path, monkeypatch, capsys):
    from test_readme import losses, readme_example

    monkeypatch.chdir(tmp_path)
    for where in ("alone", "spark"):
        (tmp_path / where).mkdir()
        (tmp_path / where / "train.py").write_text(readme_example("every-strategy"))
    monkeypatch.chdir(tmp_path / "alone")
    monkeypatch.setattr(sys, "argv", ["train.py", "dp"])
    try:
        runpy.run_path("train.py", run_name="__main__")  # one process, in this one
    finally:
        loom.shutdown()
    alone = losses(capsys.readouterr().out)["dp"]
    monkeypatch.chdir(tmp_path / "spark")
    exec(readme_example("spark"), {})  # the README's Spark example, as written
    under_spark = losses(capsys.readouterr().out)["dp"]
    assert under_spark[0] == alone[0] > 0
    assert under_spark[1] == pytest.approx(alone[1], abs=1e-5)


@pytest.mark.timeout(10)
def test_bad_arguments_are_refused_naming_the_value(tmp_path):
    with pytest.raises(ValueError, match="num_processes must be an int >= 1, got 0"):
        loom.spark.run(train, num_processes=0)
    with pytest.raises(FileNotFoundError, match="missing.py"):
        loom.spark.run(str(tmp_path / "missing.py"))
    with pytest.raises(TypeError, match=r"keyword arguments \['steps'\]"):
        loom.spark.run(str(WORKERS / "spark_train.py"), steps=3)
