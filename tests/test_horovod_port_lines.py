"""docs/horovod.md's promise about the lines a Horovod script changes, checked (issue 36): the diff on the page
touches the lines the text says, and the committed example changes nothing else against a Horovod script."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "horovod.md"
EXAMPLE = ROOT / "src" / "loom" / "examples" / "horovod_mnist.py"


def _first_diff(text: str) -> list[str]:
    block = re.search(r"```diff\n(.*?)```", text, re.S)
    assert block, "docs/horovod.md has no diff block"
    return block.group(1).splitlines()


@pytest.mark.unit
def test_the_pages_diff_touches_the_lines_its_text_counts():
    text = PAGE.read_text()
    diff = _first_diff(text)
    removed = [line[1:] for line in diff if line.startswith("-")]
    added = [line[1:] for line in diff if line.startswith("+")]
    # Horovod's pytorch_mnist.py (examples/pytorch): `import horovod` then `import horovod.torch as hvd`
    assert removed == ["import horovod", "import horovod.torch as hvd"] and added == [
        "import loom.horovod as hvd"
    ]
    assert "`pytorch_mnist.py` touches\n2 lines" in text or "pytorch_mnist.py` touches 2 lines" in text
    assert "one changed line" not in text


@pytest.mark.unit
def test_the_example_names_loom_only_in_its_import():
    """Every other line is a Horovod script's: no `loom` name in the code (the docstring and comments aside)."""
    tree = ast.parse(EXAMPLE.read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    loom_imports = [ast.unparse(n) for n in imports if "loom" in ast.unparse(n)]
    assert loom_imports == ["import loom.horovod as hvd"]
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {name for name in names | attributes if "loom" in name}
