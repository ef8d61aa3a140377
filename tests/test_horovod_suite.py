"""loom_bench.horovod_suite's tally: a test passes only if it passed on every rank; a test some rank started
and never finished is the one a hang or crash stopped."""

from __future__ import annotations

import pytest

from loom_bench.horovod_suite import _verdicts

pytestmark = pytest.mark.unit


def events(*items: tuple[str, str, str]) -> list[dict]:
    out = []
    for event, test, when in items:
        out.append({"event": "start", "test": test})
        if event != "start":
            reason = "" if event == "passed" else f"{event} {test}"
            out.append({"event": event, "test": test, "when": when, "reason": reason})
            out.append({"event": "finish", "test": test})
    return out


def test_a_test_passes_only_when_it_passed_on_every_rank():
    rank0 = events(("passed", "a", "call"), ("passed", "b", "call"), ("skipped", "c", "call"))
    rank1 = events(("passed", "a", "call"), ("failed", "b", "call"), ("skipped", "c", "call"))
    outcomes, unfinished = _verdicts([rank0, rank1])
    assert {k: v["outcome"] for k, v in outcomes.items()} == {"a": "passed", "b": "failed", "c": "skipped"}
    assert outcomes["b"]["reasons"] == ["failed b"]
    assert unfinished is None


def test_the_test_in_progress_when_a_job_stopped_is_reported():
    rank0 = events(("passed", "a", "call"), ("start", "hang", ""))
    rank1 = events(("passed", "a", "call"), ("passed", "hang", "call"))
    outcomes, unfinished = _verdicts([rank0, rank1])
    assert unfinished == "hang"
    # the call passed but teardown (hvd.barrier, hvd.shutdown) never returned: still unfinished
    in_teardown = [*events(("passed", "a", "call")), {"event": "start", "test": "t"},
                   {"event": "passed", "test": "t", "when": "call", "reason": ""}]  # fmt: skip
    outcomes, unfinished = _verdicts([in_teardown, in_teardown])
    assert unfinished == "t" and outcomes["t"]["outcome"] == "passed"
