"""Shared fixtures: run N worker processes of a script without the launcher, always cleaned up."""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from warm_pool import WarmPool

WORKERS = Path(__file__).parent / "workers"

# `auto` all-reduce caches its calibration per host; tests must neither read a stale one nor leave one behind.
_CACHE = tempfile.TemporaryDirectory(prefix="loom-test-cache-")
os.environ["LOOM_CACHE_DIR"] = _CACHE.name

WARM_POOL = WarmPool()
"""Rank processes forked from one interpreter that has imported torch and loom (tests/warm_pool.py): the ~2 s
of CPU each fresh interpreter spent importing them, once per session instead of once per rank."""


def worker_ports(worker: str) -> range:
    """The ports `free_port` draws from in xdist worker ``worker`` (``gw0``, ``gw1``, ...; "" without xdist):
    3,000 of its own per worker, below the kernel's ephemeral range (32768 on)."""
    base = os.environ.get("LOOM_TEST_PORT_BASE")  # several pytest runs on one machine: a range each
    if base:
        return range(int(base), int(base) + 3000)
    if not worker:
        return range(20000, 26000)
    index = int(worker[2:])
    return range(20000 + 3000 * index, 23000 + 3000 * index)


_PORTS = worker_ports(os.environ.get("PYTEST_XDIST_WORKER", ""))
_HANDED: set[int] = set()


def free_port() -> int:
    """A port free on loopback now, drawn from this xdist worker's range (`worker_ports`, below the kernel's
    ephemeral range): no ``bind(0)`` anywhere on the machine gets it meanwhile, nor does the other worker of
    `make test`, which draws from another range; a port is handed out once per session."""
    draw = random.Random()
    for _ in range(2000):
        port = draw.choice(_PORTS)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORTS}")


def _kill_group(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children of any of its threads), depth first."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                children += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return [d for c in children for d in (c, *_descendants(c))]


def run_diagnosed(cmd: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)``, except that on a timeout every
    process under it is described (state, kernel wait channel, command) and its Python processes are sent SIGABRT,
    which ``PYTHONFAULTHANDLER=1`` (set here) turns into every thread's stack in the output, before the
    `AssertionError` with all of it: a job that does not end says where it is stuck."""
    env = dict(popen.pop("env", None) or os.environ, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        tree = []
        for pid in [*_descendants(proc.pid), proc.pid]:  # the launcher last: it forwards the others' stacks
            with contextlib.suppress(OSError):
                status, wchan, command = (
                    Path(f"/proc/{pid}/{name}").read_text() for name in ("status", "wchan", "cmdline")
                )
                state = next(line for line in status.splitlines() if line.startswith("State:"))
                command = command.replace("\0", " ")[:200]
                tree.append(f"pid {pid} {state.split(':')[1].strip()} wchan={wchan}: {command}")
                if "python" in command:
                    if pid == proc.pid:
                        time.sleep(3)
                    os.kill(pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
        raise AssertionError(
            f"{cmd} did not end within {timeout} s; its processes then:\n"
            + "\n".join(tree)
            + f"\n--- stdout:\n{out[-3000:]}\n--- stderr (stacks after SIGABRT):\n{err[-12000:]}"
        ) from None
    finally:
        _kill_group(proc)


TORCH_TEARDOWN_ABORT = "terminate called without an active exception"
"""What torch's own teardown sometimes prints when it aborts a rank after a torchrun script ended (seen in CI under
load, in reference runs that do not import loom)."""


def torch_reference(run, tries: int = 3):
    """``run()`` (a reference run under torchrun that asserts on its exit status), started again up to ``tries``
    times when, and only when, it failed with `TORCH_TEARDOWN_ABORT`: that run is torch's, not loom's; any other
    failure, or the last one, is raised."""
    for attempt in range(tries):
        try:
            return run()
        except AssertionError as error:
            if TORCH_TEARDOWN_ABORT not in str(error) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def run_workers(
    script: str | Path, world_size: int, *args: str, timeout: float = 90.0, cwd: Path | None = None
) -> list[str]:
    """Run tests/workers/<script> (or the script at an absolute path) as ranks 0..world_size-1 of one job, in
    ``cwd``; return each rank's stdout.

    Each process gets its own session; when one fails or time runs out, all are killed with whatever they
    started, and the error names the rank and shows its stderr.
    """
    port, secret = free_port(), secrets.token_hex(32)
    logs = tempfile.TemporaryDirectory(prefix="loom-test-")
    procs, outs, errs = [], [], []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            LOOM_JOB_SECRET=secret,  # as `loom run` hands out: loom's own sockets authenticate with it
        )
        out = open(Path(logs.name) / f"{rank}.out", "w+")  # noqa: SIM115 - closed in finally
        err = open(Path(logs.name) / f"{rank}.err", "w+")  # noqa: SIM115
        outs.append(out)
        errs.append(err)
        cmd = [sys.executable, str(WORKERS / script), *args]
        procs.append(WARM_POOL.spawn(cmd, env=env, stdout=out, stderr=err, cwd=cwd))

    def text(files, rank: int) -> str:
        files[rank].flush()
        files[rank].seek(0)
        return files[rank].read()

    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r = failed[0]
                raise AssertionError(f"rank {r} of {script} exited {codes[r]}:\n{text(errs, r)[-4000:]}")
            if all(c == 0 for c in codes):
                return [text(outs, r) for r in range(world_size)]
            if time.monotonic() > deadline:
                stuck = [r for r, c in enumerate(codes) if c is None]
                raise AssertionError(f"ranks {stuck} of {script} did not finish within {timeout} s")
            time.sleep(0.05)
    finally:
        for proc in procs:
            _kill_group(proc)
        for f in outs + errs:
            f.close()
        logs.cleanup()


LANES = ("unit", "multiprocess", "system")


def pytest_sessionfinish(session, exitstatus):
    WARM_POOL.close()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Refuse the collection when a test has no lane marker, or more than one: `-m unit` (the fast lane) and
    `make test` rely on every test saying which lane it belongs to (pyproject.toml lists them)."""
    wrong = []
    for item in items:
        lanes = sorted({m.name for m in item.iter_markers() if m.name in LANES})
        if len(lanes) != 1:
            wrong.append(f"{item.nodeid}: {lanes or 'no lane marker'}")
    gpu = [item for item in items if any(m.name == "gpu" for m in item.iter_markers())]
    if gpu and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (the GPU lane: `make test-gpu` on a GPU machine)")
        for item in gpu:
            item.add_marker(skip)
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) need exactly one of @pytest.mark.{', @pytest.mark.'.join(LANES)} "
            "(a module-level `pytestmark = pytest.mark.unit` marks a whole file):\n  " + "\n  ".join(wrong)
        )
    if hasattr(config, "workerinput"):  # an xdist worker: the order the controller hands units out in
        items[:] = longest_first(items)


FILE_SECONDS = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
"""Each test file's seconds in a full run (setup, call and teardown of its tests: ``pytest --durations=0``; the run
of 2026-11-28 at load ~8), to hand the longest files to xdist's workers first."""


def longest_first(items: list) -> list:
    """``items`` with the units of `FILE_SECONDS` (a file, or the files of `SHARED_WORKER`) longest first, each
    unit's tests in their own order. xdist's ``--dist loadfile`` hands units out in collection order (we turn its
    reordering by test count off): by count, the few-test system files, the longest, came last and one worker ran
    them alone at the end. A file not listed counts 1 s a test."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_unit(item.nodeid), []).append(item)

    def seconds(unit: str) -> float:
        files = [f for f, u in SHARED_WORKER.items() if u == unit] or [Path(unit).name]
        return sum(FILE_SECONDS.get(f, 0.0) for f in files) or float(len(units[unit]))

    return [item for unit in sorted(units, key=lambda u: -seconds(u)) for item in units[unit]]


def _unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_WORKER.get(Path(path).name, path)


def _cuda_available() -> bool:
    """Whether the GPU lane runs: a CUDA device, or its dry run on the CPU (``LOOM_GPU_LANE_DEVICE=cpu``,
    tests/test_gpu.py)."""
    import torch

    return torch.cuda.is_available() or os.environ.get("LOOM_GPU_LANE_DEVICE") == "cpu"


SHARED_WORKER = {"test_ray.py": "ray-spark", "test_spark.py": "ray-spark", "test_loopback.py": "ray-spark"}
"""Files whose tests share one xdist worker: each starts a local Ray or Spark instance (test_loopback both),
so they run one after the other rather than beside each other (memory, and Ray's per-machine session)."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``pytest -n N --dist loadfile`` (`make test`): xdist's file scheduling (every test of a file on
    one worker, in file order, so a module-scoped fixture such as one `loom run` shared by a file's tests
    runs once), with the files of `SHARED_WORKER` as one unit. Other ``--dist`` modes are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = (
        False  # the collection's order (`longest_first`), not xdist's by test count
    )
    return FileScheduling(config, log)


def _refuse_processes(lane_test: str):
    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{lane_test} is marked `unit` but started a process. HINT: mark it `multiprocess` or `system`."
        )

    return refuse


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A `unit` test runs in this process alone: starting a subprocess, forking or spawning fails it, so the
    fast lane's marker is checked each time the lane runs, not trusted."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import _posixsubprocess

    refuse = _refuse_processes(request.node.nodeid)
    monkeypatch.setattr(subprocess, "_fork_exec", refuse)  # subprocess's own reference to fork_exec
    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)  # multiprocessing's spawn
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    monkeypatch.setattr(os, "posix_spawnp", refuse)
    yield


@pytest.fixture
def workers():
    return run_workers


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that calls ``loom.init()`` in this process (a worker script imported as the one-process reference)
    starts a process group of one, as every one-process job does; it ends with the test, so the next test finds
    torch.distributed as a fresh process would."""
    yield
    from loom import topology

    if topology._current is not None:
        topology.shutdown()
