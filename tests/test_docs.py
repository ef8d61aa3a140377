"""Every python block of the documentation pages and the README runs, as written.

Blocks are found in README.md and docs/**/*.md. What precedes a ```python block decides how it runs:

- nothing: the page's unmarked blocks run in order, in one namespace, in one fresh single-process interpreter
  whose working directory is a temporary one (a later block may use what an earlier one defined);
- ``<!-- run: loom run -n N [OPTIONS] [-- ARGS] -->``: the block is a script, run as N ranks of one job. With
  ``-n N`` alone it is started as ``torchrun``/``loom run`` start a rank (the same environment, one process per
  rank, `conftest.run_workers`), otherwise by ``loom run`` itself (e.g. ``--servers 1``);
- ``<!-- example: NAME -->``: the block is run by a named test elsewhere (`EXAMPLES` says which);
- ``<!-- skip: REASON -->``: not run; the reason is required and is shown on the page's source.

Blocks that are not Python (shell commands, JSON, command-line output) are fenced as ``bash``, ``json`` or
``text``; a ``loom run`` line in a ``bash`` block is checked against the command line's parser.
A script that should prove something asserts it (most compare against a single-process reference).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import run_workers
from test_launcher import run_loom

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = {
    "every-strategy": "tests/test_readme.py (4 strategies on 4 ranks, the parameter server under loom run)",
    "spark": "tests/test_spark.py (under TorchDistributor)",
}
FENCE = re.compile(
    r"(?:<!--\s*(?P<marker>[a-z]+):\s*(?P<arg>[^\n]*?)\s*-->\s*\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)```",
    re.S,
)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    marker: str | None
    arg: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start("lang")) + 1
        found.append(
            Block(page, line, m.group("lang"), m.group("code"), m.group("marker"), m.group("arg") or "")
        )
    return found


ALL = [b for page in PAGES for b in blocks(page)]


@pytest.mark.unit
def test_markers_attach_to_the_block_right_below_them_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run: loom run -n 2 -->\n```python\na = 1\n```\n\n<!-- note: not a marker of what follows -->\n"
        "text\n\n```python\nb = 2\n```\n<!-- skip: shown, not run -->\n\n```python\nc = 3\n```\n```bash\nls\n```\n"
    )
    found = [(b.line, b.lang, b.marker, b.arg, b.code) for b in blocks(page)]
    assert found == [
        (2, "python", "run", "loom run -n 2", "a = 1\n"),
        (9, "python", None, "", "b = 2\n"),
        (14, "python", "skip", "shown, not run", "c = 3\n"),
        (17, "bash", None, "", "ls\n"),
    ]


PYTHON = [b for b in ALL if b.lang == "python"]
SCRIPTS = [b for b in PYTHON if b.marker == "run"]
PAGES_WITH_BLOCKS = sorted({b.page for b in PYTHON if b.marker is None}, key=str)


@pytest.mark.unit
def test_every_fence_is_marked_with_its_language_and_every_marker_is_known():
    for b in ALL:
        assert b.lang, f"{b.where}: a code block without a language; fence it as python, bash, json or text"
        assert b.marker in (None, "run", "example", "skip"), f"{b.where}: unknown marker <!-- {b.marker}: -->"
        if b.marker == "skip":
            assert len(b.arg) >= 10, f"{b.where}: <!-- skip: REASON --> needs the reason, got {b.arg!r}"
        if b.marker == "example":
            assert b.arg in EXAMPLES, (
                f"{b.where}: no test runs <!-- example: {b.arg} --> (known: {list(EXAMPLES)})"
            )
        if b.marker is not None:
            assert b.lang == "python", f"{b.where}: <!-- {b.marker}: --> stands before a {b.lang} block"
    assert {b.arg for b in PYTHON if b.marker == "example"} == set(EXAMPLES)


RUNNER = """
import sys
namespace = {"__name__": "__main__"}
for path, where in zip(sys.argv[1::2], sys.argv[2::2]):
    print(f"--- {where}", flush=True)
    exec(compile(open(path).read(), where, "exec"), namespace)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("page", PAGES_WITH_BLOCKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_python_blocks_of_a_page_run_in_order_in_one_process(page, tmp_path):
    args = []
    for i, b in enumerate(x for x in PYTHON if x.page == page and x.marker is None):
        path = tmp_path / f"block{i}.py"
        path.write_text(b.code)
        args += [str(path), b.where]
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *args], cwd=tmp_path, capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def _loom_run_args(b: Block) -> tuple[list[str], list[str]]:
    """``loom run OPTIONS -- ARGS`` of a ``run`` marker -> (OPTIONS, ARGS)."""
    words = shlex.split(b.arg)
    assert words[:2] == ["loom", "run"], (
        f"{b.where}: <!-- run: --> must say `loom run -n N ...`, got {b.arg!r}"
    )
    options, _, args = " ".join(words[2:]).partition(" -- ")
    return options.split(), args.split()


@pytest.mark.system
@pytest.mark.timeout(200)
@pytest.mark.parametrize("block", SCRIPTS, ids=lambda b: b.where)
def test_a_script_block_runs_as_the_job_its_marker_names(block, tmp_path):
    options, args = _loom_run_args(block)
    script = tmp_path / "script.py"
    script.write_text(block.code)
    if len(options) == 2 and options[0] == "-n":
        run_workers(script, int(options[1]), *args, timeout=170, cwd=tmp_path)  # raises naming a failed rank
        return
    done = run_loom(["run", *options, "--run-dir", tmp_path / "run", script, *args], tmp_path, 170)
    assert done.returncode == 0, f"{block.where}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


@pytest.mark.unit
def test_every_loom_command_line_of_the_pages_parses():
    from loom.cli import _build_parser

    parser = _build_parser()
    commands = [
        (b.where, line.strip())
        for b in ALL
        if b.lang == "bash"
        for line in b.code.splitlines()
        if re.match(r"\s*(sudo \S+ )?loom (run|demo|report|bench|plan)\b", line)
    ]
    assert len(commands) >= 10, commands
    for where, line in commands:
        words = shlex.split(line.split("#")[0])
        words = words[words.index("loom") + 1 :]
        try:
            parser.parse_args(words)
        except SystemExit:
            pytest.fail(f"{where}: `loom {' '.join(words)}` is refused by loom's command line")
