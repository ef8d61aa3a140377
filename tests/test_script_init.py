"""Unported torchrun scripts under ``loom run`` (issue 36): a script's own ``init_process_group()`` joins loom's
authenticated store (`loom.launch.script_init`), and what cannot work is refused at once, naming the fix.

The system tests run the scripts unmodified under ``loom run`` and under ``torchrun`` (python -m
torch.distributed.run) and compare the final parameters bitwise: the same DDP arithmetic on the same data."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_diagnosed, torch_reference

from loom.launch import script_init
from loom.net.store import LoomStore, StoreServer

WORKERS = Path(__file__).parent / "workers"
SECRET = "ab" * 32


@pytest.fixture
def under_loom_run(monkeypatch):
    """This process as a `loom run` worker sees it: MASTER_ADDR:MASTER_PORT is a loom store (in this process)."""
    server = StoreServer("127.0.0.1", 0, bytes.fromhex(SECRET))
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port), RANK="0", WORLD_SIZE="1",
                            LOOM_STORE_PREFIX="loom/test/job/", LOOM_JOB_SECRET=SECRET).items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOOM_ON_WORKER_FAILURE", raising=False)
    script_init.install()
    yield server
    script_init.uninstall()
    server.close()


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_env_and_tcp_rendezvous_at_the_job_address_meet_in_loom_store(under_loom_run):
    port = under_loom_run.port
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=5)))
    assert isinstance(store, LoomStore) and (rank, world) == (0, 1)
    assert store.prefix.startswith("loom/test/job/script")
    store.set("k", b"v")
    assert store.get("k") == b"v"  # through the authenticated connection
    for host in ("127.0.0.1", "localhost"):
        again, _, _ = next(dist.rendezvous(f"tcp://{host}:{port}?rank=0&world_size=1"))
        assert isinstance(again, LoomStore) and again.prefix != store.prefix  # a fresh group: fresh keys


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_destroyed_group_is_kept_until_the_process_ends(under_loom_run):
    # its destructor, run when the script's main() returned, could deadlock on the GIL (a job that never ended)
    from torch.distributed import destroy_process_group  # as scripts import it, after loom's install

    dist.init_process_group("gloo")  # env:// at the job address: loom's store
    group = dist.group.WORLD
    destroy_process_group()
    assert not dist.is_initialized() and any(kept is group for kept in script_init._kept)
    script_init.uninstall()
    assert dist.destroy_process_group is dist.distributed_c10d.destroy_process_group  # put back as it was
    assert dist.destroy_process_group.__module__ == "torch.distributed.distributed_c10d"
    script_init._kept.clear()


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_tcpstore_at_the_job_address_is_refused_at_once_and_elsewhere_is_torchs(under_loom_run):
    with pytest.raises(script_init.StoreNotForTorch, match=r"loom's authenticated store.*HINT: call"):
        dist.TCPStore("127.0.0.1", under_loom_run.port, 2, False, timeout=datetime.timedelta(seconds=600))
    with pytest.raises(script_init.StoreNotForTorch):
        dist.TCPStore(host_name="localhost", port=under_loom_run.port, is_master=False)
    own = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5)
    )  # its own port: torch's
    own.set("a", "b")
    assert own.get("a") == b"b" and isinstance(own, dist.TCPStore)
    script_init.uninstall()
    assert dist.TCPStore is torch._C._distributed_c10d.TCPStore  # put back as it was


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_healing_job_refuses_the_scripts_own_group(under_loom_run, monkeypatch):
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", "heal")
    with pytest.raises(script_init.StoreNotForTorch, match="--on-worker-failure heal.*HINT: run with"):
        next(dist.rendezvous("env://"))


@pytest.mark.unit
def test_nothing_is_installed_outside_loom_run(monkeypatch):
    monkeypatch.delenv("LOOM_STORE_PREFIX", raising=False)
    before = dict(script_init.torch_rendezvous._rendezvous_handlers)
    script_init.install()
    assert script_init.torch_rendezvous._rendezvous_handlers == before and not script_init._installed


# -- the scripts, unmodified, under loom run and torchrun ----------------------------------------------------------
def _launch(launcher: list[str], script: str, args: list[str], cwd: Path, timeout: float = 200) -> str:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(WORKERS), env.get("PYTHONPATH", "")]))
    # (a job that trained and then did not end failed a CI twice: on a timeout, every process's stack is shown)
    proc = run_diagnosed([sys.executable, *launcher, str(WORKERS / script), *args], timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def _baseline(n: int, script: str, args: list[str], cwd: Path) -> str:
    """The reference run under torchrun, started again on torch's own teardown abort (`conftest.torch_reference`)."""
    return torch_reference(lambda: _launch(_torchrun(n), script, args, cwd))


def _loom(n: int, *options: str) -> list[str]:
    return ["-m", "loom.cli", "run", "-n", str(n), *options]


def _torchrun(n: int) -> list[str]:
    from conftest import free_port

    return ["-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", str(free_port())]


def _bitwise_equal(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.system
@pytest.mark.timeout(600)
def test_the_tutorial_form_ddp_script_under_loom_run_equals_torchrun_at_1_and_2(tmp_path):
    for n in (2, 1):
        ours, theirs = tmp_path / f"loom{n}.safetensors", tmp_path / f"torchrun{n}.safetensors"
        out = _launch(_loom(n), "torchrun_tutorial.py", ["3", str(ours)], tmp_path)
        assert "epoch 2 done" in out, out[-2000:]
        _baseline(n, "torchrun_tutorial.py", ["3", str(theirs)], tmp_path)
        assert _bitwise_equal(ours, theirs), f"-n {n}: loom run and torchrun differ"


@pytest.mark.system
@pytest.mark.timeout(600)
def test_a_restarted_group_rejoins_and_tcp_init_at_the_job_address_works(tmp_path):
    """Rank 1 exits after its first epoch on attempt 0; the group restarts (``--max-restarts 1``), and the new
    attempt's ``init_process_group(init_method="tcp://MASTER_ADDR:MASTER_PORT")`` joins a fresh round."""
    ours, theirs = tmp_path / "loom.safetensors", tmp_path / "torchrun.safetensors"
    out = _launch(_loom(2, "--max-restarts", "1"), "torchrun_tutorial.py",
                  ["2", str(ours), "--fail-on-first-attempt", "1", "--init", "tcp"], tmp_path)  # fmt: skip
    assert "restarting the worker group, attempt 2 of 2" in out, out[-3000:]
    _baseline(2, "torchrun_tutorial.py", ["2", str(theirs), "--init", "env"], tmp_path)
    assert _bitwise_equal(ours, theirs)


@pytest.mark.system
@pytest.mark.timeout(300)
def test_nanogpts_own_ddp_script_under_loom_run_equals_torchrun(tmp_path):
    ours, theirs = tmp_path / "loom.safetensors", tmp_path / "torchrun.safetensors"
    out = _launch(_loom(2), "nanogpt_ddp.py", [str(ours)], tmp_path)
    assert "iter 4: loss" in out
    _baseline(2, "nanogpt_ddp.py", [str(theirs)], tmp_path)
    assert _bitwise_equal(ours, theirs)


RAW_STORE = """
import datetime, os, torch.distributed as dist
dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
              False, timeout=datetime.timedelta(minutes=30))
"""


@pytest.mark.system
@pytest.mark.timeout(120)
def test_a_raw_tcpstore_at_the_job_port_is_refused_naming_the_fix_not_a_30_minute_retry(tmp_path):
    script = tmp_path / "raw_store.py"
    script.write_text(RAW_STORE)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "run", "-n", "2", str(script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=100)  # fmt: skip
    assert proc.returncode != 0
    assert (
        "StoreNotForTorch" in proc.stderr
        and "HINT: call torch.distributed.init_process_group()" in proc.stderr
    )


@pytest.mark.system
@pytest.mark.timeout(400)
def test_the_tutorial_form_script_on_two_hosts_equals_torchrun_on_one(tmp_path):
    """Two network-namespace hosts, one `loom run` each (``--nnodes 2``): the script's own group spans them."""
    from netns import bridged_hosts, can_make_namespaces

    if not can_make_namespaces():
        pytest.skip("needs root and iproute2 for network namespaces")
    ours, theirs = tmp_path / "hosts.safetensors", tmp_path / "torchrun.safetensors"
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env.pop("GLOO_SOCKET_IFNAME", None)  # each launcher binds gloo to the interface holding its address
    # LOOM_ZYGOTE=0: under heavy load a zygote that answers a fork request after the launcher's 30 s wait forks
    # the worker anyway, beside the fresh interpreter the launcher started instead (two rank 1s seen here, one
    # failing to connect); reported, and not what this test is about.
    env.update(OMP_NUM_THREADS="1", LOOM_JOB_SECRET=os.urandom(32).hex(), LOOM_ZYGOTE="0")
    with bridged_hosts(2, subnet=81) as hosts:
        procs = [
            subprocess.Popen(host.command(sys.executable, "-m", "loom.cli", "run", "-n", "1", "--nnodes", "2",
                                          "--node-rank", str(i), "--master", f"{hosts[0].address}:29400",
                                          str(WORKERS / "torchrun_tutorial.py"), "2", str(ours)),
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, host in enumerate(hosts)
        ]  # fmt: skip
        try:
            outputs = [p.communicate(timeout=250)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(outputs)
    _baseline(2, "torchrun_tutorial.py", ["2", str(theirs)], tmp_path)
    assert _bitwise_equal(ours, theirs)
