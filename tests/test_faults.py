"""The shared fault injector (tests/workers/faults.py): its text form, who it hits, and what each kind does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from workers.faults import ATTEMPT_ENV, ENV, Fault, Injector, parse, plan

from conftest import WORKERS  # isort: skip


@pytest.mark.unit
def test_the_text_form_round_trips_and_a_malformed_item_is_named():
    faults = [Fault("nan", 0, 3), Fault("kill", 1, 5, attempt=0), Fault("skip", 2, 1), Fault("freeze", 3, 9)]
    assert plan(*faults) == "nan@0:3,kill@1:5#0,skip@2:1,freeze@3:9"
    assert parse(plan(*faults)) == faults and parse("") == [] and parse(" nan@0:3 , ") == [Fault("nan", 0, 3)]
    for bad, message in [("nan@0", "'nan@0' is not KIND@RANK:STEP"), ("boom@0:1", "unknown fault kind 'boom'"),
                         ("kill@1:0", "step >= 1")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse(bad)


@pytest.mark.unit
def test_only_this_ranks_faults_of_this_attempt_fire_at_their_step():
    env = {ENV: "kill@1:5#0,nan@1:2,nan@0:2,skip@1:4", ATTEMPT_ENV: "1"}
    injector = Injector.from_env(1, env)
    assert injector.faults == [Fault("nan", 1, 2), Fault("skip", 1, 4)]  # the kill was for attempt 0 only
    assert [injector.skips(step) for step in range(1, 6)] == [False, False, False, True, False]
    batch = (torch.ones(2, 3), torch.ones(2, 1))
    injector.before_step(1, batch)
    assert torch.isfinite(batch[0]).all()
    injector.before_step(2, batch)
    assert (
        torch.isnan(batch[0][0, 0])
        and int(torch.isnan(batch[0]).sum()) == 1
        and torch.isfinite(batch[1]).all()
    )
    assert injector.fired == [Fault("skip", 1, 4), Fault("nan", 1, 2)]
    empty = (torch.ones(0, 3), torch.ones(0, 1))
    Injector(0, [Fault("nan", 0, 1)]).before_step(1, empty)  # an empty share stays as it is
    assert Injector.from_env(0, {}).faults == []


def _script_under(fault: str, steps: int = 6) -> subprocess.Popen:
    """A loop of ``steps`` steps that prints each one, with ``fault`` in its environment."""
    code = f"""
        import sys; sys.path.insert(0, {str(WORKERS)!r})
        from faults import Injector
        faults = Injector.from_env(0, on_fire=lambda f: print("fired", f, flush=True))
        for step in range(1, {steps + 1}):
            faults.before_step(step)
            print("step", step, flush=True)
        """
    env = dict(os.environ, **{ENV: fault})
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_kill_ends_the_process_by_sigkill_before_its_step():
    proc = _script_under("kill@0:3")
    out, _ = proc.communicate(timeout=50)
    assert proc.returncode == -signal.SIGKILL
    assert out.split("\n")[:-1] == ["step 1", "step 2", "fired kill@0:3"]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_freeze_stops_the_process_before_its_step_until_it_is_continued():
    proc = _script_under("freeze@0:2")
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns when the process stops (or ends)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        os.kill(proc.pid, signal.SIGCONT)
        out = proc.stdout.read()  # type: ignore[union-attr]
        assert out.split("\n")[:-1] == ["step 1", "fired freeze@0:2", *(f"step {s}" for s in range(2, 7))]
    finally:
        proc.kill()
        proc.wait()
