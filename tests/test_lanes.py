"""The test lanes (pyproject.toml, tests/conftest.py): every test says its lane, and a `unit` test that starts a
process fails, so `make test-fast` (`pytest -m unit`) stays one process and the lanes stay honest."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_make_test_runs_the_idle_tests_beside_the_others_and_those_timed_against_a_bound_alone_last():
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    recipe = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    runs = [line.strip() for line in recipe.splitlines() if "bin/pytest" in line]
    assert runs == [
        '@LOOM_TEST_PORTS=26000-29399 $(VENV)/bin/pytest -p no:xdist -p no:cacheprovider -m "idle and not alone" \\',
        '$(VENV)/bin/pytest -p no:xdist -m "not idle and not alone"; main=$$?; \\',
        "$(VENV)/bin/pytest -p no:xdist -m alone",
    ]
    assert "> build/test-idle.log 2>&1 & idle=$$!" in recipe and "wait $$idle" in recipe
    assert "test $$main -eq 0 && test $$idle_status -eq 0" in recipe  # either failing fails `make test`
    config = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '    "alone: ' in config and '    "idle: ' in config
    low, high = 26000, 29399  # the idle pytest's ports are not the main one's (conftest's default range)
    assert range(20000, 26000) == conftest._PORTS and not set(conftest._PORTS) & set(range(low, high + 1))
