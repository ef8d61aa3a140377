"""`loom run` command-line edges (issue 13, item 8): each fails within seconds, with one `loom run:` line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = pytest.mark.system

LOOM = [sys.executable, "-m", "loom.cli"]
QUICK_S = 60.0
"""A failure "without waiting out a default": the join timeouts here are 3-4 s and starting Python and torch takes
5-10 s on the 2 shared cores of the development host (several times that under load), while the case this guards
against waits the default join timeout, 120 s (`loom.launch.agent`). Half of that: a bound load cannot reach, a
wait for the default still fails. The time taken is printed."""


def run(args: list[str], cwd: Path, prefix: list[str] = (), secret: bool = True, timeout: float = 90.0):
    env = dict(os.environ)
    env.pop("LOOM_JOB_SECRET", None)
    if secret:
        env["LOOM_JOB_SECRET"] = os.urandom(32).hex()
    start = time.monotonic()
    proc = subprocess.run(
        [*prefix, *LOOM, "run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    took = time.monotonic() - start
    print(f"loom run {' '.join(args)}: {took:.1f} s")
    return proc, took


def assert_one_clear_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if "loom run:" in line]
    assert proc.returncode != 0, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert "loom run: loom run:" not in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text("import loom\nloom.init()\nprint('ran')\n")
    return path


@pytest.mark.timeout(120)
def test_a_missing_script_has_one_prefix(tmp_path):
    proc, took = run(["no_such_script.py"], tmp_path)
    assert_one_clear_line(proc, "script 'no_such_script.py' does not exist")
    assert took < QUICK_S


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("master", "needle"),
    [
        ("notahost:99999", "port must be in 1..65535, got 99999"),
        ("127.0.0.1:0", "port must be in 1..65535, got 0"),
        (f"no-such-host-{uuid.uuid4().hex[:8]}.invalid:29500", "does not resolve"),
        ("127.0.0.1", "must be ADDR:PORT"),
        ("127.0.0.1:http", "must be ADDR:PORT"),
    ],
    # fixed ids: the random host name would differ between the collections of `make test`'s xdist workers
    ids=["port-99999", "port-0", "unresolvable-host", "no-port", "port-http"],
)
def test_a_bad_master_is_refused_at_once(tmp_path, script, master, needle):
    proc, took = run(["--nnodes", "2", "--node-rank", "1", "--master", master, str(script)], tmp_path)
    assert_one_clear_line(proc, needle)
    assert proc.returncode == 2
    assert took < QUICK_S


@pytest.mark.timeout(120)
def test_a_multi_node_job_without_a_secret_is_refused(tmp_path, script):
    master = f"127.0.0.1:{free_port()}"
    proc, _ = run(
        ["--nnodes", "2", "--node-rank", "0", "--master", master, str(script)], tmp_path, secret=False
    )
    assert_one_clear_line(proc, "LOOM_JOB_SECRET", "--insecure-no-secret")
    assert proc.returncode == 2


@pytest.mark.timeout(120)
def test_a_master_that_never_comes_is_given_up_naming_it(tmp_path, script):
    master = f"127.0.0.1:{free_port()}"  # nothing listens there
    args = ["--nnodes", "2", "--node-rank", "1", "--master", master, "--join-timeout", "3", str(script)]
    proc, took = run(args, tmp_path)
    assert_one_clear_line(proc, f"the master at {master}", "--join-timeout", "HINT")
    assert took < QUICK_S, took


@pytest.mark.timeout(120)
def test_node_0_gives_up_on_a_node_that_never_joins(tmp_path, script):
    master = f"127.0.0.1:{free_port()}"
    args = ["--nnodes", "2", "--node-rank", "0", "--master", master, "--join-timeout", "3", str(script)]
    proc, took = run(args, tmp_path)
    assert_one_clear_line(proc, "node(s) [1] did not join", master)
    assert took < QUICK_S, took


@pytest.mark.timeout(120)
def test_a_node_with_another_secret_is_refused_naming_the_secret(tmp_path, script):
    """Node 0 waits; node 1 brings a different LOOM_JOB_SECRET: it is told so, and does not join."""
    master = f"127.0.0.1:{free_port()}"
    args = ["--nnodes", "2", "--master", master, "--join-timeout", "4", str(script)]
    env = dict(os.environ, LOOM_JOB_SECRET=os.urandom(32).hex())
    node0 = subprocess.Popen(
        [*LOOM, "run", "--node-rank", "0", *args], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        time.sleep(1.5)
        proc, took = run(["--node-rank", "1", *args], tmp_path)
        assert_one_clear_line(proc, "LOOM_JOB_SECRET")
        assert took < QUICK_S
        _, err0 = node0.communicate(timeout=60)
        assert node0.returncode != 0 and "node(s) [1] did not join" in err0, err0
    finally:
        if node0.poll() is None:
            node0.kill()
            node0.communicate()


def _netns_usable() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _netns_usable(), reason="needs root and iproute2 for network namespaces")
def test_an_unreachable_master_is_named_at_once(tmp_path, script):
    """A host with no route to the master (a namespace with loopback only): one line, at once."""
    ns = f"loomedge{os.getpid() % 100000}"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True)
        args = ["--nnodes", "2", "--node-rank", "1", "--master", "10.77.93.1:29500", str(script)]
        proc, took = run(args, tmp_path, prefix=["ip", "netns", "exec", ns])
        assert_one_clear_line(proc, "10.77.93.1:29500")
        assert took < QUICK_S
    finally:
        subprocess.run(["ip", "netns", "pids", ns], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", [["--backend", "ray"], ["--cluster", '{"hosts": []}']])
def test_server_restarts_are_refused_where_servers_are_not_restarted(tmp_path, script, where):
    proc, _ = run([*where, "--max-server-restarts", "2", str(script)], tmp_path)
    assert_one_clear_line(proc, "--max-server-restarts", "not restarted yet")
    assert proc.returncode == 2 and "ran" not in proc.stdout
