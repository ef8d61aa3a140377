"""`--max-restarts` on a two-node job: each attempt is a fresh round of loom's rendezvous, on both nodes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

LOOM = [sys.executable, "-m", "loom.cli"]

SCRIPT = """
    import os, torch, torch.distributed as dist, loom
    topo = loom.init()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and topo.rank == 1:
        raise RuntimeError("fail on the first attempt only")
    x = torch.ones(1)
    dist.all_reduce(x)
    print(f"rank {topo.rank} sum {x.item():g}")
"""


@pytest.mark.system
@pytest.mark.timeout(150)
def test_two_nodes_restart_together_after_a_failure_on_one(tmp_path):
    script = tmp_path / "restart_two_nodes.py"
    script.write_text(textwrap.dedent(SCRIPT))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    env = dict(os.environ, LOOM_JOB_SECRET=os.urandom(32).hex())
    nodes = [
        subprocess.Popen(
            [
                *LOOM,
                "run",
                "-n",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--master",
                master,
                "--max-restarts",
                "1",
                "--run-dir",
                str(tmp_path / f"node{n}"),
                str(script),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for n in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert [p.returncode for p in nodes] == [0, 0], outputs
    assert "[rank0]: rank 0 sum 2" in outputs[0] and "[rank1]: rank 1 sum 2" in outputs[1], outputs


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_restart_line_names_the_attempts_log_folder():
    """Attempts count from 1 in the line, their folders from 0 (``logs/attempt_K``): the line names the failed
    attempt's folder and the next one's."""
    from loom.launch.restarts import restart_line

    line = restart_line({}, 1, 2)
    assert (
        "a worker on another node failed (logs/attempt_0); restarting the worker group, attempt 2 of 3 "
        in line
    )
    assert "(logs/attempt_1; --max-restarts 2)" in line, line
