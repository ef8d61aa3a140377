"""A parameter-server worker's model after its step (issue 37, item 7): the push's reply carries the parameters
after the update, so ``job.module`` holds them when ``train_step`` returns (it lagged one update, pulled at the
start of the step), a skipped non-finite step leaves them unchanged, and after the last step they equal the
servers'; the next step's pull sends no second copy of values the worker holds (``have``)."""

from __future__ import annotations

import pytest
from ps_helpers import parameter_servers, run_ps_workers


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_after_train_step_the_module_holds_the_updated_parameters(mode):
    with parameter_servers(2) as cluster:
        out = run_ps_workers("ps_after_step.py", 1, {"mode": mode}, cluster.env, timeout=150)[0][0]
    after = out["after"]  # the initial weight, then after each of 5 steps; step 3 was non-finite
    assert after[1] != after[0], "step 1's update is not in job.module when train_step returns"
    assert after[3] == after[2], "the skipped non-finite step 3 changed job.module"
    assert after[4] != after[3] and after[5] != after[4]
    assert out["mine"] == out["server"], "after the last step job.module differs from the servers'"


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_worker_host_waiting_for_a_server_host_says_so(capsys):
    """A ``--cluster`` worker host waits up to --join-timeout for its servers' host: a line every ``notice_s``
    names what it waits for (it printed nothing for 120 s)."""
    from conftest import free_port

    from loom.launch.servers import wait_for_servers

    missing = [f"127.0.0.1:{free_port()}"]
    assert wait_for_servers(missing, timeout_s=1.0, poll_s=0.05, notice_s=0.3) == missing
    lines = [
        line for line in capsys.readouterr().err.splitlines() if "waiting for parameter server(s)" in line
    ]
    assert lines and missing[0] in lines[0] and "--join-timeout 1 s" in lines[0], lines
