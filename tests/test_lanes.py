"""The test lanes (pyproject.toml, tests/conftest.py): every test says its lane, and a `unit` test that starts a
process fails, so `make test-fast` (`pytest -m unit`) stays one process and the lanes stay honest."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import conftest
import pytest

pytestmark = pytest.mark.unit


class _Item:
    def __init__(self, nodeid: str, *lanes: str) -> None:
        self.nodeid, self._marks = (
            nodeid,
            [pytest.mark.timeout(5).mark, *(getattr(pytest.mark, n).mark for n in lanes)],
        )

    def iter_markers(self):
        return iter(self._marks)


def test_a_test_with_no_lane_or_two_fails_the_collection_naming_it():
    fine = [_Item("t.py::a", "unit"), _Item("t.py::b", "multiprocess"), _Item("t.py::c", "system")]
    conftest.pytest_collection_modifyitems(None, fine)
    with pytest.raises(pytest.UsageError) as refused:
        conftest.pytest_collection_modifyitems(
            None, [*fine, _Item("t.py::none"), _Item("t.py::two", "unit", "system")]
        )
    message = str(refused.value)
    assert "2 test(s) need exactly one of @pytest.mark.unit" in message
    assert "t.py::none: no lane marker" in message and "t.py::two: ['system', 'unit']" in message


def test_the_lanes_are_registered_and_unknown_markers_refused():
    config = (Path(__file__).parents[1] / "pyproject.toml").read_text()  # tomllib is Python 3.11+
    assert 'addopts = "-ra --durations=30 --strict-markers"' in config
    for lane in conftest.LANES:
        assert f'    "{lane}: ' in config, lane


def test_a_unit_test_cannot_start_a_process():
    for start in (
        lambda: subprocess.run([sys.executable, "-c", "pass"], check=False),
        lambda: os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], os.environ),
        os.fork,
    ):
        with pytest.raises(AssertionError, match="is marked `unit` but started a process"):
            start()


class _XdistConfig:
    def __init__(self, dist: str) -> None:
        self.values = {"dist": dist, "tx": ["2*popen"]}
        self.option = types.SimpleNamespace(loadscopereorder=True)

    def getvalue(self, name: str):
        return self.values[name]


def test_make_test_schedules_a_file_on_one_worker_and_ray_and_spark_files_together():
    pytest.importorskip("xdist", reason="pytest-xdist (requirements/test.lock) runs `make test`'s workers")
    scheduler = conftest.pytest_xdist_make_scheduler(_XdistConfig("loadfile"), None)
    scope = scheduler._split_scope
    assert (
        scope("tests/test_guard.py::test_a[dp]")
        == scope("tests/test_guard.py::test_b")
        == "tests/test_guard.py"
    )
    assert scope("tests/test_fit.py::test_a") != scope("tests/test_guard.py::test_a")
    together = {
        scope(f"tests/{name}::test_x") for name in ("test_ray.py", "test_spark.py", "test_loopback.py")
    }
    assert together == {"ray-spark"}
    assert conftest.pytest_xdist_make_scheduler(_XdistConfig("load"), None) is None  # xdist's own


def test_the_longest_files_are_handed_out_first_each_kept_whole(monkeypatch):
    # xdist's loadfile hands out files by test count; the few-test system files, the longest, then came last
    monkeypatch.setattr(conftest, "FILE_SECONDS", {"test_a.py": 5.0, "test_b.py": 50.0, "test_ray.py": 20.0,
                                                   "test_spark.py": 40.0})  # fmt: skip
    config = _XdistConfig("loadfile")
    conftest.pytest_xdist_make_scheduler(config, None)
    assert config.option.loadscopereorder is False  # the collection's order is the order handed out
    names = ["test_a.py::t1", "test_a.py::t2", "test_b.py::t1", "test_ray.py::t1", "test_new.py::t1",
             "test_spark.py::t1", "test_a.py::t3"]  # fmt: skip
    items = [types.SimpleNamespace(nodeid=f"tests/{n}") for n in names]
    order = [i.nodeid.removeprefix("tests/") for i in conftest.longest_first(items)]
    assert order == ["test_ray.py::t1", "test_spark.py::t1", "test_b.py::t1", "test_a.py::t1", "test_a.py::t2",
                     "test_a.py::t3", "test_new.py::t1"]  # fmt: skip


def test_make_test_runs_two_workers_by_file_then_the_tests_timed_against_a_bound_alone():
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    recipe = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    runs = [line.strip() for line in recipe.splitlines() if "bin/pytest" in line]
    assert runs == [
        '$(VENV)/bin/pytest -n 2 --dist loadfile -m "not alone"',
        "$(VENV)/bin/pytest -p no:xdist -m alone",
    ]
    config = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '    "alone: ' in config


def test_each_xdist_worker_draws_ports_from_its_own_range(monkeypatch):
    monkeypatch.delenv("LOOM_TEST_PORT_BASE", raising=False)
    ranges = [conftest.worker_ports(name) for name in ("", "gw0", "gw1")]
    assert ranges[0] == range(20000, 26000)
    assert not set(ranges[1]) & set(ranges[2]) and all(r.stop <= 32768 for r in ranges)
    monkeypatch.setenv("LOOM_TEST_PORT_BASE", "5000")  # a run beside another gets the range it was given
    assert conftest.worker_ports("gw1") == range(5000, 8000)
