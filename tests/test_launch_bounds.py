"""Bounded launcher input (issue 25, item 3): every case was reproduced against the old launcher, which grew to
2.2 GB on ``-n 1000000``, hung on a FIFO, printed a RecursionError traceback, or waited silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

from loom import cli
from loom.launch.bounds import MAX_NPROC_PER_CORE, default_max_nproc, json_nesting_depth
from loom.launch.spec import LaunchSpec
from loom.launcher_env import read_launcher_env

CLI_TIMED = """
import sys, time
started = time.monotonic()
import loom.cli
imported = time.monotonic()
status = loom.cli.main(sys.argv[1:])
print(f"IMPORT {imported - started:.2f} CHECK {time.monotonic() - imported:.2f}", file=sys.stderr)
sys.exit(status)
"""


def one_line(err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("loom run:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text("print('ran')\n")
    return path


@pytest.mark.system
@pytest.mark.timeout(60)
def test_a_million_workers_are_refused_before_anything_is_created(tmp_path, script):
    """The old launcher made ~90,000 log directories in 60 s here. Now: exit 2, one line, the directory
    untouched; the check itself is printed (not asserted: timing belongs in benchmarks)."""
    before = sorted(tmp_path.iterdir())
    result = subprocess.run([sys.executable, "-c", CLI_TIMED, "run", "-n", "1000000", str(script)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=50)  # fmt: skip
    assert result.returncode == 2, result.stderr
    bound = default_max_nproc()
    one_line(
        result.stderr,
        "-n/--nproc 1000000",
        f"bound of {bound}",
        f"{MAX_NPROC_PER_CORE} per core",
        "--max-nproc",
    )
    assert sorted(tmp_path.iterdir()) == before  # no runs/ directory, no logs
    print(result.stderr.splitlines()[-1])


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_bound_is_the_cores_times_a_factor_and_max_nproc_overrides_it(script):
    bound = default_max_nproc()
    assert bound == MAX_NPROC_PER_CORE * (os.cpu_count() or 1)
    LaunchSpec(target=str(script), nproc=bound)
    with pytest.raises(ValueError, match=f"-n/--nproc {bound + 1} is more worker processes than the bound"):
        LaunchSpec(target=str(script), nproc=bound + 1)
    LaunchSpec(target=str(script), nproc=bound + 1, max_nproc=bound + 1)
    with pytest.raises(ValueError, match="--servers 5 is more .* than the bound of 4 \\(--max-nproc\\)"):
        LaunchSpec(target=str(script), servers=5, max_nproc=4)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_directory_as_the_script_is_called_a_directory(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path)]) == 2
    one_line(capsys.readouterr().err, "is a directory")


@pytest.mark.unit
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "args",
    [["run", "-n", "0"], ["run", "-n", "two"], ["run", "--max-restarts", "-1"], ["run", "--max-heals", "-1"],
     ["run", "--min-workers", "0"], ["demo", "--epochs", "0"], ["launch"]],
)  # fmt: skip
def test_a_bad_option_value_is_one_line_naming_it_and_exit_2(args, script, capsys):
    """argparse's error without its usage dump (it printed 11 lines of usage first)."""
    with pytest.raises(SystemExit) as stop:
        cli.main([*args, str(script)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"loom{' ' * (args[0] != 'launch')}") and "--help lists the options" in err, err
    assert args[-1] in err, err


@pytest.mark.unit
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("args", "needle"),
    [(["-n", "2", "nothere.py"], "script 'nothere.py' does not exist (working directory "),
     (["-n", "2", "--on-worker-failure", "heal", "--min-workers", "3"], "1..2 (-n). HINT: give --min-workers at "
      "most 2"),
     (["--on-worker-failure", "continue", "--max-restarts", "1"], "got --max-restarts 1. HINT: leave it out")],
)  # fmt: skip
def test_a_refused_launch_names_the_fix(args, needle, script, capsys):
    """Each said what was wrong but not the fix; continue's named the default --nnodes 1 as a conflict."""
    assert cli.main(["run", *args, str(script)]) == 2
    assert "HINT" in one_line(capsys.readouterr().err, needle)


def _spec(nproc: int = 1, ports: list[int] | None = None) -> dict:
    hosts: list[dict] = [{"address": "127.0.0.1", "role": "worker", "nproc": nproc}]
    if ports is not None:
        hosts.append({"address": "127.0.0.2", "role": "server", "ports": ports})
    return {"master_port": free_port(), "hosts": hosts}


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["nesting", "fifo", "directory", "ports", "nproc", "server host ports"])
def test_each_cluster_spec_edge_case_is_one_line_and_exit_2(case, tmp_path, script, capsys, monkeypatch):
    """100k nested brackets (was a RecursionError traceback), a FIFO (hung), 58,976 ports on a server host
    (``OSError: Argument list too long``), ``"nproc": 1000000`` (hung), a directory."""
    monkeypatch.setenv("LOOM_JOB_SECRET", os.urandom(32).hex())
    path, index = tmp_path / "cluster.json", "0"
    needles: tuple[str, ...]
    if case == "nesting":
        path.write_text("[" * 100_000 + "]" * 100_000)
        needles = ("nested 100000 brackets deep",)
    elif case == "fifo":
        os.mkfifo(path)
        needles = ("is a FIFO (named pipe), not a regular file",)
    elif case == "directory":
        path = tmp_path
        needles = ("is a directory, not a regular file",)
    elif case == "ports":
        path.write_text(json.dumps(_spec(ports=list(range(1024, 1024 + 58_976)))))
        needles = ("58976 parameter-server ports in all (at most 1024)",)
    elif case == "nproc":
        path.write_text(json.dumps(_spec(nproc=1_000_000)))
        needles = ("hosts[0].nproc 1000000 is more worker processes than the bound", "--max-nproc")
    else:
        path.write_text(json.dumps(_spec(ports=list(range(20000, 20000 + default_max_nproc() + 1)))))
        needles, index = ("hosts[1].ports lists", "--max-nproc"), "1"
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--cluster", str(path), "--host-index", index, str(script)]) == 2
    one_line(capsys.readouterr().err, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_nesting_depth_skips_strings():
    assert json_nesting_depth('{"a": [1, {"b": "[[[[{{{"}]}') == 3
    assert json_nesting_depth('"\\"[[[" ') == 0


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_server_host_that_never_comes_is_named_within_the_join_timeout(
    tmp_path, script, capsys, monkeypatch
):
    """The old launcher started the workers, whose clients gave up after 60 s with a traceback."""
    monkeypatch.setenv("LOOM_JOB_SECRET", os.urandom(32).hex())
    monkeypatch.chdir(tmp_path)
    missing = f"127.0.0.2:{free_port()}"  # nothing listens there
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(_spec(ports=[int(missing.rpartition(":")[2])])))
    started = time.monotonic()
    status = cli.main(
        ["run", "--cluster", str(path), "--host-index", "0", "--join-timeout", "2", str(script)]
    )
    print(f"server host reported after {time.monotonic() - started:.1f} s (--join-timeout 2)")
    assert status == 1
    one_line(capsys.readouterr().err, f"parameter server(s) {missing}", "--join-timeout 2 s", "HINT")
    assert not (tmp_path / "runs").exists()


@pytest.mark.unit
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "notaport"},
         "MASTER_PORT='notaport' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"},
         "MASTER_PORT=70000 is not a port"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is below 1"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}, "RANK=2 is outside 0..1"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK=-1 is below 0"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "29500"}, "MASTER_ADDR is not set"),
    ],
)  # fmt: skip
def test_the_launcher_environment_is_checked_naming_the_variable(monkeypatch, env, needle):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="HINT") as error:
        read_launcher_env()
    assert needle in str(error.value)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_lone_process_says_which_ranks_never_came(tmp_path):
    """``python script.py`` with ``WORLD_SIZE=2 RANK=0`` and no peer was silent for 75+ s (torch's store waits
    30 minutes); now it fails at LOOM_JOIN_TIMEOUT_S naming rank 1 and the timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "LOOM_STORE"))}
    env.update(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               LOOM_JOIN_TIMEOUT_S="3")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", "import loom; loom.init(); print('joined')"], env=env,
                            capture_output=True, text=True, timeout=80, cwd=tmp_path)  # fmt: skip
    assert result.returncode != 0
    assert "joined" not in result.stdout
    assert "rank 0: rank(s) [1] of WORLD_SIZE=2 did not join at MASTER_ADDR:MASTER_PORT" in result.stderr
    assert "within 3 s (LOOM_JOIN_TIMEOUT_S)" in result.stderr


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_demo_is_bounded_too(capsys):
    assert cli.main(["demo", "-n", "1000000"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("loom demo: -n/--nproc 1000000 is more worker processes than the bound")
        and "HINT" in err
    )


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_local_ray_instance_is_bounded_like_loom_run(tmp_path, script, capsys, monkeypatch):
    """--backend ray without --address starts every worker on this host; with --address the cluster places them."""
    pytest.importorskip("ray")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--backend", "ray", "-n", "1000000", str(script)]) == 2
    one_line(capsys.readouterr().err, "-n/--nproc 1000000 is more worker processes than the bound")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py"]


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_max_nproc_cannot_raise_the_bound_past_what_the_host_memory_holds(script):
    """``--max-nproc 1000000 -n 1000000`` grew the launcher to 2.3 GB and 245,000 directories (issue 37)."""
    from loom.launch.bounds import MIN_WORKER_BYTES, memory_max_nproc

    held = memory_max_nproc()
    assert held is not None and held * MIN_WORKER_BYTES <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES"
    )
    with pytest.raises(
        ValueError, match=rf"-n/--nproc {held + 1} is more .* memory can hold \({held}: .*HINT"
    ):
        LaunchSpec(target=str(script), nproc=held + 1, max_nproc=10 * held)
