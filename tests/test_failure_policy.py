"""``--on-worker-failure continue`` only where it holds (issue 25, item 4): DiLoCo under it was accepted, then both
survivors crashed with gloo's 'Connection reset by peer' and nothing finished. Strategies whose ranks cannot go on
without a lost one now refuse to start under it, naming the alternatives; Gossip and asynchronous parameter
servers accept it (their survivors finish: test_gossip.py, test_ps_launch.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import loom
from loom.parallel._setup import check_failure_policy
from loom.topology import Topology

ONE = Topology(0, 1, 0, 1, "none")
LAUNCHED = Topology(0, 1, 0, 1, "gloo")  # a launched job's: the refusal comes before any collective

REFUSED = {
    "DataParallel": lambda topology: loom.DataParallel(topology=topology),
    "LocalSGD": lambda topology: loom.LocalSGD(topology=topology),
    "DiLoCo": lambda topology: loom.DiLoCo(topology=topology),
    "ParameterServer(mode='sync')": lambda topology: loom.ParameterServer(mode="sync", topology=topology),
}


def _model():
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(REFUSED))
def test_strategies_that_need_every_rank_refuse_continue_naming_the_alternatives(name, monkeypatch):
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", "continue")
    model, optimizer = _model()
    with pytest.raises(ValueError) as error:
        REFUSED[name](LAUNCHED).setup(model, optimizer, nn.functional.mse_loss)
    message = str(error.value)
    assert message.startswith(f"--on-worker-failure continue: {name} cannot go on without a lost worker")
    for alternative in ("--on-worker-failure stop", "--max-restarts N", "Gossip", "mode='async'"):
        assert alternative in message


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_policy_is_checked_only_under_continue(monkeypatch):
    model, optimizer = _model()
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", "stop")
    loom.DiLoCo(topology=ONE).setup(model, optimizer, nn.functional.mse_loss)
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", "continue")
    check_failure_policy("Gossip", survives_lost_worker=True, backend="gloo")
    with pytest.raises(
        ValueError, match="ParameterServer\\(mode='async'\\)"
    ):  # asynchronous passes the check:
        check_failure_policy("X", survives_lost_worker=False, backend="gloo")
    with pytest.raises(ValueError, match="needs server addresses"):  # ...and fails later, for another reason
        loom.ParameterServer(mode="async", topology=ONE, addresses=[]).setup(model, optimizer, nn.MSELoss())


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("policy", ["continue", "heal"])
def test_a_one_process_job_inside_a_launched_job_is_a_plain_job_whatever_the_policy(policy, monkeypatch):
    """A reference or evaluation model given an explicit backend="none" topology has no peer to lose: the
    launcher's policy does not apply to it (one rule for continue and heal: `failure_policy`)."""
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", policy)
    model, optimizer = _model()
    job = loom.ParameterServer(mode="sync", topology=ONE, addresses=[])
    with pytest.raises(
        ValueError, match="needs server addresses"
    ):  # past the policy: fails for its own reason
        job.setup(model, optimizer, nn.functional.mse_loss)
    check_failure_policy("ShardedDataParallel", survives_lost_worker=False, backend="none")


DILOCO = """
import torch
from torch import nn
import loom

loom.init()
model = nn.Linear(4, 1)
job = loom.DiLoCo(sync_every=2).setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)
print("set up")
"""


@pytest.mark.system
@pytest.mark.timeout(120)
def test_diloco_under_continue_is_refused_at_start_up_through_loom_run(tmp_path: Path):
    """The reproduction: ``loom run -n 2 --on-worker-failure continue`` of a DiLoCo script."""
    script = tmp_path / "diloco_job.py"
    script.write_text(DILOCO)
    env = dict(os.environ, LOOM_JOB_SECRET=os.urandom(32).hex())
    result = subprocess.run(
        [sys.executable, "-m", "loom.cli", "run", "-n", "2", "--on-worker-failure", "continue",
         "--run-dir", str(tmp_path / "run"), str(script)],
        env=env, capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "set up" not in result.stdout
    assert "Connection reset by peer" not in result.stderr
    # Both ranks refuse; whichever the launcher sees end first is named with the reason, the other "the same way".
    first = re.search(r"loom run: worker rank (\d) failed \(exit code 1\): StartRefused: --on-worker-failure "
                      r"continue: DiLoCo cannot go on without a lost worker", result.stderr)  # fmt: skip
    assert first is not None, result.stderr[-3000:]
    assert "HINT: use --on-worker-failure stop (the default) with --max-restarts N" in result.stderr
    assert "Traceback" not in result.stderr  # a refusal is a message (loom.launch.worker), not a crash
    assert f"loom run: worker rank {1 - int(first.group(1))} failed the same way" in result.stderr
    assert "loom run: every worker failed the same way (ranks [0, 1])" in result.stderr
