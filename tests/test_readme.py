"""The README's training script, run as written: every strategy trains to the same loss as the others.

The other blocks of the README and the documentation are run by tests/test_docs.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_workers
from test_launcher import run_loom

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"


def readme_example(marker: str) -> str:
    """The first ```python block after ``<!-- example: marker -->`` in the README or, failing that, in the
    documentation pages (docs/**/*.md): the scripts the tests run as written."""
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        found = re.search(rf"<!-- example: {marker} -->\s*```python\n(.*?)```", page.read_text(), re.S)
        if found:
            return found.group(1)
    raise AssertionError(f"no python block after <!-- example: {marker} --> in README.md or docs/")


def losses(stdout: str) -> dict[str, tuple[int, float]]:
    """``name: S steps, loss L`` lines (raw or ``[rankN]: ``-prefixed) -> {name: (S, L)} (any rank's)."""
    found = re.findall(r"(\w+): (\d+) steps, loss ([0-9.]+)", stdout)
    return {name: (int(steps), float(loss)) for name, steps, loss in found}


@pytest.mark.system
@pytest.mark.timeout(300)
def test_every_strategy_of_the_readme_script_trains_to_the_same_loss(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_example("every-strategy"))
    outputs = run_workers(script, 4, "dp", "pipeline", "tp", "hybrid", timeout=240, cwd=tmp_path)
    got = losses(outputs[0])
    assert set(got) == {"dp", "pipeline", "tp", "hybrid"}, outputs[0]
    assert all(rank_out.count(" steps, loss ") == 4 for rank_out in outputs)  # every rank prints them
    steps, reference = got["dp"]
    assert steps == 3 * 256 // 32
    for name, (n, loss) in got.items():
        assert n == steps and abs(loss - reference) <= 1e-5, (name, loss, reference)
    served = run_loom(
        ["run", "-n", 2, "--servers", 1, "--run-dir", tmp_path / "run", script, "ps"], tmp_path, 180
    )
    assert served.returncode == 0, served.stderr[-3000:]
    assert losses(served.stdout)["ps"][0] == steps
    assert abs(losses(served.stdout)["ps"][1] - reference) <= 1e-5
    # Run again: every job resumes from its final checkpoint and takes no step.
    again = losses(run_workers(script, 4, "dp", "hybrid", timeout=120, cwd=tmp_path)[0])
    assert again == {"dp": got["dp"], "hybrid": got["hybrid"]}
