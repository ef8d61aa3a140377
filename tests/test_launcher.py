"""`loom run`: rank-prefixed output, fast failure naming the rank, reliable restarts, signals, no orphans."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

LOOM = [sys.executable, "-m", "loom.cli"]


def processes_mentioning(marker: str, cwd: Path | None = None) -> list[int]:
    """PIDs of live processes whose command line contains ``marker`` (zombies excluded); with ``cwd``, only those
    working there (another test's processes on the other xdist worker may carry the same marker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if cwd is not None and Path(os.readlink(entry / "cwd")) != cwd:
                continue
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def wait_until_gone(marker: str, timeout: float = 10.0, cwd: Path | None = None) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(marker, cwd)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def run_loom(
    args: list, cwd: Path, timeout: float = 60.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``loom ARGS`` in ``cwd`` with ``env`` added to this environment; killed with its group past ``timeout``."""
    proc = subprocess.Popen(
        [*LOOM, *map(str, args)],
        cwd=cwd,
        env=None if env is None else {**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"loom {args} did not finish within {timeout} s") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.system
@pytest.mark.timeout(60)
def test_output_is_prefixed_with_the_rank_and_collectives_work(tmp_path):
    script = write_script(
        tmp_path,
        "hello_job.py",
        """
        import torch, torch.distributed as dist, loom
        topo = loom.init()
        x = torch.tensor([topo.rank + 1.0])
        dist.all_reduce(x)
        print(f"hello from {topo.rank} of {topo.world_size}: {x.item():g}")
    """,
    )
    result = run_loom(["run", "-n", 3, "--run-dir", tmp_path / "run", script], tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in range(3):
        assert f"[rank{rank}]: hello from {rank} of 3: 6" in result.stdout
    assert (tmp_path / "run" / "logs").is_dir()
    assert wait_until_gone(str(script)) == []


@pytest.mark.system
@pytest.mark.timeout(150)
def test_a_failing_worker_stops_the_job_quickly_and_is_named(tmp_path):
    script = write_script(
        tmp_path,
        "failing_job.py",
        """
        import sys, time, loom
        topo = loom.init()
        if topo.rank == 1:
            open(sys.argv[1], "w").write(str(time.time()))
            raise ValueError("bad value on purpose")
        time.sleep(120)  # rank 0 would hang for two minutes if nobody stopped it
    """,
    )
    stamp = tmp_path / "raised_at"
    result = run_loom(["run", "-n", 2, "--run-dir", tmp_path / "run", script, stamp], tmp_path, timeout=140)
    finished = time.time()
    print(f"the job ended {finished - float(stamp.read_text()):.1f} s after rank 1 raised")
    assert result.returncode != 0
    assert "worker rank 1 failed" in result.stderr
    assert "ValueError: bad value on purpose" in result.stderr
    assert "[rank1]: Traceback" in result.stderr and "[rank1]: [rank1]:" not in result.stderr, "labelled once"
    # the last lines: the attempt that failed, no restart left, and the summary naming the run directory
    said, summary = result.stderr.strip().splitlines()[-2:]
    want = "loom run: the job failed in attempt 1 of 1 (logs/attempt_0); no restart left (--max-restarts 0)"
    assert said == want, said
    assert summary.startswith("loom run: failed after ") and summary.endswith(
        f"2 worker(s), 0 restart(s); logs and metrics in {tmp_path / 'run'}"
    ), summary
    # Stopped, not waited for: rank 0 sleeps 120 s; half of that is a bound load does not reach.
    assert finished - float(stamp.read_text()) < 60.0
    assert wait_until_gone(str(script)) == []


RESTART_SCRIPT = """
    import os, sys, torch, torch.distributed as dist, loom
    topo = loom.init()
    attempt, failing = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(sys.argv[1])
    if attempt < failing and topo.rank == attempt % 2:
        raise RuntimeError(f"fail on attempt {attempt} on purpose")
    x = torch.ones(1)
    dist.all_reduce(x)
    print(f"attempt {attempt} rank {topo.rank} sum {x.item():g}")
"""


@pytest.mark.system
@pytest.mark.timeout(300)
def test_restart_after_a_failure_works_every_time(tmp_path):
    """Three restarts in one launch (each rank failing in turn): every one forms the group again. (It was three
    launches: 110 s of the suite under load for the same path taken six more times.)"""
    script = write_script(tmp_path, "restart_job.py", RESTART_SCRIPT)
    result = run_loom(
        ["run", "-n", 2, "--max-restarts", 3, "--run-dir", tmp_path / "run", script, 3], tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[rank0]: attempt 3 rank 0 sum 2" in result.stdout, result.stdout[-2000:]
    assert "[rank1]: attempt 3 rank 1 sum 2" in result.stdout, result.stdout[-2000:]
    restarts = [line for line in result.stderr.splitlines() if "restarting the worker group" in line]
    assert [line.split(";")[0] for line in restarts] == [
        f"loom run: worker rank {attempt % 2} failed (exit code 1): RuntimeError: fail on attempt {attempt} on purpose "
        f"(logs/attempt_{attempt})"
        for attempt in range(3)
    ], result.stderr[-2000:]
    assert "3 restart(s)" in result.stderr.strip().splitlines()[-1]
    assert wait_until_gone(str(script)) == []


@pytest.mark.system
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "on_failure"),
    [
        ("SIGTERM", "stop"),
        ("SIGINT", "stop"),
        ("SIGHUP", "stop"),
        ("SIGKILL", "stop"),
        ("SIGTERM", "continue"),
        ("SIGKILL", "continue"),
    ],
)
def test_signals_to_the_launcher_leave_no_worker_behind(tmp_path, how, on_failure):
    script = write_script(
        tmp_path,
        f"sleepy_job_{how}_{on_failure}.py",
        """
        import time, loom
        topo = loom.init()
        print("ready", flush=True)
        time.sleep(120)
    """,
    )
    proc = subprocess.Popen(
        [
            *LOOM,
            "run",
            "-n",
            "2",
            "--on-worker-failure",
            on_failure,
            "--run-dir",
            str(tmp_path / "run"),
            str(script),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len(processes_mentioning(str(script))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # let the workers get into their script
        assert len(processes_mentioning(str(script))) >= 3, "launcher and two workers did not start"
        proc.send_signal(getattr(signal, how))
        code = proc.wait(timeout=20)
        assert code != 0
        assert wait_until_gone(str(script), timeout=15) == [], f"orphan workers after {how}"
        if how != "SIGKILL":  # the launcher handled it: its workers stopped, and it says so
            out = proc.communicate()[0]
            assert f"stopped by signal {how}" in out and code == 128 + getattr(signal, how), (
                code,
                out[-2000:],
            )
    finally:
        for pid in processes_mentioning(str(script)):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if not proc.stdout.closed:  # read above when the launcher handled the signal
            proc.communicate()


@pytest.mark.system
@pytest.mark.timeout(90)
def test_what_a_worker_started_is_stopped_with_it_and_does_not_delay_the_restart(tmp_path):
    """A worker leads a session of its own: stopping it stops the processes it started (they hold its output
    pipes), those of the worker that failed too."""
    script = write_script(
        tmp_path,
        "child_job.py",
        """
        import os, subprocess, sys, time
        rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        child = subprocess.Popen(["sleep", "301"])
        with open(f"child-{attempt}-{rank}", "w") as f:
            f.write(str(child.pid))
        if attempt == 0 and rank == 1:
            time.sleep(1)
            sys.exit(3)
        if attempt == 0:
            time.sleep(120)
    """,
    )
    result = run_loom(
        ["run", "-n", "2", "--max-restarts", "1", "--run-dir", tmp_path / "run", script], tmp_path, 80
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "worker rank 1 failed (exit code 3): exited without a Python exception" in result.stderr, (
        result.stderr[-3000:]
    )
    children = [int((tmp_path / f"child-{a}-{r}").read_text()) for a in (0, 1) for r in (0, 1)]
    time.sleep(0.5)
    alive = [
        pid
        for pid in children
        if Path(f"/proc/{pid}").exists() and "sleep" in Path(f"/proc/{pid}/cmdline").read_text()
    ]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"the workers' children outlived them: {alive}"


@pytest.mark.system
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "-n", "2", "no_such_script.py"], "loom run: script 'no_such_script.py' does not exist"),
        (["run", "-n", "0", "x.py"], "expected a positive integer, got 0"),
        (["run", "-n", "two", "x.py"], "expected a positive integer, got 'two'"),
        (["run", "--bogus", "x.py"], "unrecognized arguments: --bogus"),
        (["run", "--nnodes", "2", "--node-rank", "0", "x.py"], "--master ADDR:PORT"),
        (["run", "--on-worker-failure", "continue", "--max-restarts", "1", "x.py"], "without restarts"),
        (["run", "--on-worker-failure", "ignore", "x.py"], "invalid choice: 'ignore'"),
        (["launch", "x.py"], "invalid choice: 'launch'"),
    ],
)
def test_bad_command_lines_get_a_clear_error(tmp_path, args, message):
    (tmp_path / "x.py").write_text("print('never run')\n")
    result = run_loom(args, tmp_path, timeout=20)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.system
@pytest.mark.timeout(90)
def test_two_nodes_on_loopback_form_one_job(tmp_path):
    env = dict(os.environ, LOOM_JOB_SECRET=os.urandom(32).hex())  # the same on both nodes
    script = write_script(
        tmp_path,
        "two_node_job.py",
        """
        import torch, torch.distributed as dist, loom
        topo = loom.init()
        x = torch.tensor([topo.rank + 1.0])
        dist.all_reduce(x)
        print(f"rank {topo.rank} of {topo.world_size} local {topo.local_rank} sum {x.item():g}")
    """,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [
                *LOOM,
                "run",
                "-n",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--master",
                f"127.0.0.1:{port}",
                "--run-dir",
                str(tmp_path / f"node{node}"),
                str(script),
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        for node in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=75)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert [p.returncode for p in nodes] == [0, 0], outputs
    combined = "".join(outputs)
    for rank in range(4):
        assert f"rank {rank} of 4" in combined and "sum 10" in combined, combined
    assert wait_until_gone(str(script)) == []


def _can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


@pytest.mark.system
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and iproute2 for network namespaces")
def test_two_hosts_in_network_namespaces(tmp_path):
    """Two "hosts" joined by a veth pair: each runs `loom run` with the multi-node flags, nothing on loopback."""
    env = dict(os.environ, LOOM_JOB_SECRET=os.urandom(32).hex())
    tag = f"{os.getpid() % 100000}"
    hosts = [f"loomh{tag}a", f"loomh{tag}b"]
    links = [f"lv{tag}a", f"lv{tag}b"]
    addrs = ["10.77.91.1", "10.77.91.2"]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    script = write_script(
        tmp_path,
        "netns_job.py",
        """
        import os, torch, torch.distributed as dist, loom
        topo = loom.init()
        x = torch.tensor([topo.rank + 1.0])
        dist.all_reduce(x)
        print(f"rank {topo.rank} of {topo.world_size} sum {x.item():g} via {os.environ['GLOO_SOCKET_IFNAME']}")
    """,
    )
    try:
        for host in hosts:
            ip("netns", "add", host)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for host, link, addr in zip(hosts, links, addrs, strict=True):
            ip("link", "set", link, "netns", host)
            ip("-n", host, "addr", "add", f"{addr}/24", "dev", link)
            ip("-n", host, "link", "set", link, "up")
            ip("-n", host, "link", "set", "lo", "up")
        port = 29000 + os.getpid() % 1000  # a fresh namespace has no other listener
        nodes = [
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    host,
                    *LOOM,
                    "run",
                    "-n",
                    "1",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--master",
                    f"{addrs[0]}:{port}",
                    "--run-dir",
                    str(tmp_path / host),
                    str(script),
                ],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                env=env,
            )
            for node, host in enumerate(hosts)
        ]
        try:
            outputs = [p.communicate(timeout=90)[0] for p in nodes]
        finally:
            for p in nodes:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
        assert [p.returncode for p in nodes] == [0, 0], outputs
        combined = "".join(outputs)
        assert "rank 0 of 2 sum 3" in combined and "rank 1 of 2 sum 3" in combined, combined
        assert f"via {links[0]}" in combined and f"via {links[1]}" in combined
    finally:
        for host in hosts:
            subprocess.run(["ip", "netns", "pids", host], capture_output=True)
            subprocess.run(["ip", "netns", "del", host], capture_output=True)


PS_JOB = """
    import json, torch, loom
    from torch import nn
    from torch.utils.data import TensorDataset
    topo = loom.init()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, x @ torch.randn(8, 2, generator=g))
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    job = loom.ParameterServer(mode="sync").setup(model, opt, nn.functional.mse_loss)
    loader = loom.data.loader(data, 16, seed=0)
    losses = [job.train_step(batch) for epoch in range(2) for batch in loader]
    print("LOSSES " + json.dumps(losses))
"""


@pytest.mark.system
@pytest.mark.timeout(90)
def test_servers_flag_starts_parameter_servers_and_stops_them(tmp_path):
    """`loom run --servers 2`: a sync parameter-server job equals one process on the same global batches."""
    script = write_script(tmp_path, "ps_job.py", PS_JOB)
    result = run_loom(
        ["run", "-n", 2, "--servers", 2, "--run-dir", tmp_path / "run", script], tmp_path, timeout=80
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[server0]: " in result.stdout and "[server1]: " in result.stdout
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("[rank0]: LOSSES"))
    losses = json.loads(line.split("LOSSES ", 1)[1])

    import torch
    from torch import nn

    from loom.data import GlobalBatchSampler

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 2, generator=g)
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = []
    sampler = GlobalBatchSampler(64, 16, seed=0)
    for _ in range(2):
        for batch in sampler:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x[batch.indices]), y[batch.indices])
            loss.backward()
            opt.step()
            reference.append(loss.item())
    assert losses == pytest.approx(reference, abs=1e-5)
    assert wait_until_gone(str(script)) == []
    assert wait_until_gone("loom.ps.server", cwd=tmp_path.resolve()) == []  # this job's servers
