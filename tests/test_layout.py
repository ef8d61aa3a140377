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


@pytest.mark.timeout(
    60
)  # reads files only, but the first test of a loaded process can wait seconds for a core
def test_every_worker_is_run_by_a_test_that_its_docstring_names():
    test_files = {t.name: t.read_text() for t in TESTS.glob("test_*.py")}
    for worker in sorted((TESTS / "workers").glob("*.py")):
        if worker.name in SHARED:
            continue
        word = re.compile(rf"\b{worker.stem}(\.py)?\b")
        users = [name for name, text in test_files.items() if worker.stem in text and word.search(text)]
        assert users, f"tests/workers/{worker.name} is run by no test"
        docstring = re.match(r'\s*"""(.*?)"""', worker.read_text(), re.S)
        assert docstring, f"tests/workers/{worker.name} has no module docstring"
        named = [u for u in users if f"tests/{u}" in docstring.group(1)]
        assert named, f"tests/workers/{worker.name}'s docstring names none of the tests that run it: {users}"


@pytest.mark.timeout(30)
def test_the_architecture_map_names_paths_that_exist_and_every_package():
    """docs/architecture.md is the map: every `path.py` or `package/` it names exists under src/loom (named from
    src/loom, or by its tail within a package), and every package of src/loom is named there."""
    src = TESTS.parent / "src" / "loom"
    text = (TESTS.parent / "docs" / "architecture.md").read_text()
    files = {p.relative_to(src).as_posix() for p in src.rglob("*.py")}
    dirs = {
        p.relative_to(src).as_posix() + "/" for p in src.rglob("*") if p.is_dir() and p.name != "__pycache__"
    }
    missing = []
    for name in set(re.findall(r"`([\w/]+(?:\.py|/))`", text)):
        known = files if name.endswith(".py") else dirs
        in_repo = (
            TESTS.parent / name
        ).exists()  # tests/..., benchmarks/..., named from the repository's root
        if name not in known and not any(k.endswith("/" + name) for k in known) and not in_repo:
            missing.append(name)
    assert not missing, (
        f"docs/architecture.md names paths that do not exist under src/loom: {sorted(missing)}"
    )
    unnamed = [
        d for d in sorted(dirs) if d not in text and not any(f.startswith(d) and f in text for f in files)
    ]
    assert not unnamed, f"docs/architecture.md names no file of these packages: {unnamed}"
