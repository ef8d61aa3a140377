"""Each worker script and the tests that run it can be found from each other."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).parent
SHARED = {
    "common.py",
    "faults.py",
    "pp_common.py",
    "nanogpt_model.py",
    "gpu_common.py",
}  # helpers imported by workers and tests, not run on their own


@pytest.mark.timeout(10)
def test_every_worker_is_run_by_a_test_that_its_docstring_names():
    test_files = {t.name: t.read_text() for t in TESTS.glob("test_*.py")}
    for worker in sorted((TESTS / "workers").glob("*.py")):
        if worker.name in SHARED:
            continue
        users = [name for name, text in test_files.items() if re.search(rf"\b{worker.stem}(\.py)?\b", text)]
        assert users, f"tests/workers/{worker.name} is run by no test"
        docstring = re.match(r'\s*"""(.*?)"""', worker.read_text(), re.S)
        assert docstring, f"tests/workers/{worker.name} has no module docstring"
        named = [u for u in users if f"tests/{u}" in docstring.group(1)]
        assert named, f"tests/workers/{worker.name}'s docstring names none of the tests that run it: {users}"
