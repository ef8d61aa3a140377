"""Every collective and point-to-point call of ``torch.distributed`` in the library names its group (issue 39,
item 4): the job's, a mesh axis's, a quorum epoch's, or the default one named as such (``dist.group.WORLD``), so
none runs on the implicit default group by accident, and the code that passes the job's group down runs as ranks
as threads (`tests/threads.py`: one explicit group per thread, no default group)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parent.parent / "src" / "loom"

COMMUNICATING = {
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv",
    "isend", "monitored_barrier", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send",
}  # fmt: skip
"""The ``torch.distributed`` functions that communicate over a process group (their ``group=`` argument)."""


def calls_without_group(source: str) -> list[tuple[int, str]]:
    """(line, call) of each ``dist.<name>(...)`` / ``torch.distributed.<name>(...)`` call of `COMMUNICATING`
    in ``source`` that passes no ``group=`` keyword."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        communicates = node.func.attr in COMMUNICATING
        on_dist = ast.unparse(node.func.value) in ("dist", "torch.distributed")
        if communicates and on_dist and not any(keyword.arg == "group" for keyword in node.keywords):
            found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.timeout(60)
def test_every_collective_in_the_library_names_its_group():
    missing = [
        f"{path.relative_to(SRC.parent)}:{line}: {call}"
        for path in sorted(SRC.rglob("*.py"))
        for line, call in calls_without_group(path.read_text())
    ]
    assert not missing, (
        "collectives on the implicit default group (pass the job's, the axis's or the caller's group; name the "
        "default one as group=dist.group.WORLD where it is meant):\n" + "\n".join(missing)
    )


@pytest.mark.timeout(10)
def test_the_check_finds_a_call_without_a_group():
    source = (
        "import torch.distributed as dist\n"
        "dist.all_reduce(t)\n"
        "dist.all_reduce(t, group=g)\n"
        "torch.distributed.broadcast(t, src=0)\n"
        "dist.send(t, 1, group=dist.group.WORLD)\n"
        "dist.get_rank()\n"
    )
    assert [line for line, _ in calls_without_group(source)] == [2, 4]
