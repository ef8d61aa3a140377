"""Every ``pip install`` hint names loom's own distribution, ``loom-train`` (issue 36): ``loom`` on PyPI is an
unrelated project, and a hint naming it installed someone else's code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "loom-train"
# an install target: a package name (with extras, a version or nothing) after `pip install` on the same line
_INSTALL = re.compile(r"pip install\s+([^\n`#;)]*)")  # up to a comment, the end of a code span or a clause
_TARGET = re.compile(r"""['"]?([A-Za-z0-9_.-]+)(\[[^\]]*\])?""")


def _files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "src").rglob("*.py")),
            *sorted((ROOT / "docs").rglob("*.md"))]  # fmt: skip


def _loom_targets(line: str) -> list[str]:
    """The words after ``pip install`` that name loom under a distribution name other than loom-train."""
    wrong = []
    for word in line.split():
        match = _TARGET.match(word)
        if match and match.group(1).lower() in ("loom", "loom_train", "loomtrain"):
            wrong.append(word)
    return wrong


@pytest.mark.unit
def test_the_distribution_is_loom_train_and_the_command_loom():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; loom supports 3.10)
    assert re.search(r'^name = "([^"]+)"', text, re.M).group(1) == DISTRIBUTION
    assert re.search(r'^\[project\.scripts\]\nloom = "loom\.cli:console"$', text, re.M)


@pytest.mark.unit
def test_no_install_hint_names_another_distribution_for_loom():
    found, wrong = 0, []
    for path in _files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for rest in _INSTALL.findall(line):
                found += DISTRIBUTION in rest
                wrong += [f"{path.relative_to(ROOT)}:{number}: {w}" for w in _loom_targets(rest)]
    assert not wrong, "install hints naming `loom` (an unrelated PyPI project): " + "; ".join(wrong)
    assert found >= 5  # the hints exist (trackers, report, demo, Ray, Spark): the grep reads them


@pytest.mark.unit
def test_the_check_catches_the_old_hint():
    assert _loom_targets("'loom[plot]'") == ["'loom[plot]'"]
    assert _loom_targets('"loom[ray]"`') and _loom_targets("loom") == ["loom"]
    assert _loom_targets("'loom-train[plot]'") == [] and _loom_targets('".[demo]"') == []
