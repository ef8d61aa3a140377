"""The files one DataParallel gradient really crosses on the default CPU path, traced (issue 39, item 5).

`tests/workers/trace_step.py` profiles one ``train_step`` of a 2-process job on one host (shared-memory
gradients, gloo) after 3 warm-up steps and lists every ``src/loom`` file the step enters. The step's own work,
from the batch to ``optimizer.step()``, must stay within `GRADIENT_PATH` (at most 8 files); the step record is a
separate, counted category (`STEP_RECORD`): `loom.observe.phases` reads the clock at the phase boundaries (no
collective of its own), and after the update is applied it writes the record (`loom.observe.metrics`), with the
step's bytes read from `loom.comm.counters`, and the engine appends the phase times to the straggler window
(`loom.observe.straggler_watch`; the judgement runs on rank 0's watchdog thread). Nothing else may run:
not the fault injector while ``LOOM_FAULTS`` is unset, not the guard's builder, not the mesh's or the topology's
look-ups (all read once at setup). ``docs/architecture.md`` names the same files in the same order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_workers

import loom.fault.inject as inject
from loom.comm.counters import CommCounters, Traffic

GRADIENT_PATH = (
    "train/engine.py",
    "parallel/data/data_parallel_job.py",
    "train/batch.py",
    "fault/watchdog.py",
    "comm/shared_gradients.py",
    "comm/shm.py",
    "comm/shm_wait.py",
    "fault/desync.py",
)
"""The step's own work, in the order of `docs/architecture.md` ("Following one DataParallel gradient")."""
STEP_RECORD = ("observe/phases.py", "comm/counters.py", "observe/metrics.py", "observe/straggler_watch.py")
"""The step's observation (see the module docstring for what of it runs before the update)."""
ALWAYS = {"train/engine.py", "parallel/data/data_parallel_job.py", "train/batch.py", "comm/shared_gradients.py",
          "comm/shm.py", "fault/desync.py", "fault/watchdog.py"}  # fmt: skip
"""Entered by every traced step (`comm/shm_wait.py` is entered only when a barrier waits or wakes a peer)."""
ARCHITECTURE = Path(__file__).parent.parent / "docs" / "architecture.md"


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_one_data_parallel_step_crosses_at_most_eight_files():
    out = run_workers("trace_step.py", 2, timeout=150)[0]
    traced = json.loads(out.strip().splitlines()[-1])
    found = [name for name, _ in traced]
    assert len(GRADIENT_PATH) <= 8
    unexpected = set(found) - set(GRADIENT_PATH) - set(STEP_RECORD)
    assert not unexpected, f"the step entered files outside its path and its record: {unexpected}\n{traced}"
    assert set(found) >= ALWAYS, f"missing from the trace: {ALWAYS - set(found)}\n{traced}"
    for category in (GRADIENT_PATH, STEP_RECORD):  # first entered in the order the page gives
        entered = [name for name in found if name in category]
        assert entered == [name for name in category if name in entered], f"another order: {entered}"


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_architecture_page_names_the_traced_path_in_order():
    text = ARCHITECTURE.read_text()
    section = text.split("## Following one DataParallel gradient", 1)[1].split("\n## ", 1)[0]
    listed = section.split("| to understand |", 1)[0]
    for category in (GRADIENT_PATH, STEP_RECORD):
        missing = [name for name in category if f"`{name}`" not in listed]
        assert not missing, f"the page does not name {missing}"
        positions = [listed.index(f"`{name}`") for name in category]
        assert positions == sorted(positions), f"the page lists {category} in another order than the trace"


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_fault_injection_is_a_hook_held_only_when_planned(monkeypatch):
    monkeypatch.setattr(inject, "_mine", None)
    monkeypatch.delenv(inject.ENV, raising=False)
    assert inject.planned() is None
    monkeypatch.setattr(inject, "_mine", None)
    monkeypatch.setenv(inject.ENV, "slow@0:99:before")
    monkeypatch.setenv("RANK", "0")
    assert inject.planned() is inject.fault_point
    monkeypatch.setattr(inject, "_mine", None)  # the next reader parses the environment again


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_tally_counts_its_calls_in_every_total_and_reset_clears_it():
    """`SharedGradients` counts its bytes as a tally (fixed per call) instead of a call into the counters."""
    counts = CommCounters()
    counts.record("ring", 10, 20)
    tally = counts.tally("shm", Traffic(shm_sent=3, shm_received=5))
    tally.calls += 2
    assert counts.totals() == (10 + 6, 20 + 10)
    assert counts.snapshot() == {"bytes_sent": 16, "bytes_received": 30, "ops": {"ring": 1, "shm": 2}}
    assert counts.by_transport()["shm"] == {"bytes_sent": 6, "bytes_received": 10}
    assert (counts.shm_bytes_sent, counts.socket_bytes_received) == (6, 20)
    counts.reset()
    assert counts.totals() == (0, 0) and counts.ops == {} and tally.calls == 0
