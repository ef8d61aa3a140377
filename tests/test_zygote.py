"""The launcher's zygote (`loom.launch.zygote`): workers forked from one process that imported torch and loom
behave as fresh ``python -u -m loom.launch.worker`` processes (environment, arguments, output, exit statuses,
uncaught exceptions, atexit, signals), requests are bounded, and a worker whose startup variables differ, or any
worker once the zygote is gone, is left to a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from loom.launch.zygote import Zygote
from loom.launch.zygote_wire import MAX_REQUEST, read_request, send_request


def _send(sock: socket.socket, payload: bytes, fds: int) -> None:
    nulls = [os.open(os.devnull, os.O_RDONLY) for _ in range(fds)]
    try:
        if payload:
            socket.send_fds(sock, [payload[:1]], nulls)
            sock.sendall(payload[1:])
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # the reader refused and closed its end
        pass
    finally:
        for fd in nulls:
            os.close(fd)


def _request(payload: bytes, fds: int = 3) -> tuple | None:
    ours, theirs = socket.socketpair()
    sender = threading.Thread(target=_send, args=(ours, payload, fds))  # (a large request fills the buffer)
    sender.start()
    try:
        got = read_request(theirs)
    finally:
        theirs.close()
        sender.join(timeout=10)
        ours.close()
    if got is not None:
        for fd in got[1]:
            os.close(fd)
    return got


def _frame(body: bytes, size: int | None = None) -> bytes:
    return (len(body) if size is None else size).to_bytes(4, "big") + body


def _json(value: object) -> bytes:
    return _frame(json.dumps(value).encode())


@pytest.mark.unit
@pytest.mark.parametrize(
    "payload, fds, error",
    [
        (_frame(b"{", MAX_REQUEST + 1), 3, "over"),
        (_json({"env": {"A": 1}, "argv": ["s.py"]}), 3, "env must map names to strings"),
        (_json({"env": {}, "argv": []}), 3, "argv must be a non-empty list"),
        (_json({"env": {}, "argv": ["s.py"]}), 1, "needs stdin, stdout and stderr; got 1"),
        (_json({"env": {}, "argv": ["s.py"]})[:-1], 3, "cut short"),
        (_frame(b"{not json"), 3, "not JSON"),
        (_json(["a list"]), 3, "must be a JSON object"),
    ],
)
def test_a_bad_request_is_refused_by_name(payload, fds, error):
    with pytest.raises(SystemExit, match=error):
        _request(payload, fds)


@pytest.mark.unit
def test_no_request_means_the_job_ended_and_a_good_one_is_read():
    assert _request(b"") is None
    request, fds = _request(_json({"env": {"A": "1"}, "argv": ["s.py", "x"]}))
    assert request == {"env": {"A": "1"}, "argv": ["s.py", "x"]} and len(fds) == 3


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_requests_sent_back_to_back_are_read_one_by_one_each_with_its_own_descriptors(tmp_path):
    """The crash of issue 37: a request sent while the zygote was still busy was read together with the one
    before it (a newline-delimited ``recv``) and its descriptors lost. Here 20 framed requests, each with three
    descriptors of its own file, all sent before the first is read."""
    ours, theirs = socket.socketpair()
    files = []
    try:
        for i in range(20):
            path = tmp_path / f"f{i}"
            path.write_text(str(i))
            fd = os.open(path, os.O_RDONLY)
            files.append(fd)
            assert send_request(ours, {"env": {"I": str(i)}, "argv": ["s.py"] * (1 + i * 50)}, [fd, fd, fd])
        for i in range(20):
            request, fds = read_request(theirs)
            assert request["env"] == {"I": str(i)} and len(request["argv"]) == 1 + i * 50
            assert len(fds) == 3
            for fd in fds:
                assert os.pread(fd, 10, 0) == str(i).encode(), "a descriptor arrived with another request"
                os.close(fd)
        ours.shutdown(socket.SHUT_WR)
        assert read_request(theirs) is None
    finally:
        for fd in files:
            os.close(fd)
        ours.close()
        theirs.close()


SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, threading, time
    import numpy
    atexit.register(lambda: print("atexit ran", flush=True))
    def late():
        time.sleep(0.3)
        print("thread joined", flush=True)
    threading.Thread(target=late).start()  # not a daemon: the process waits for it, as an interpreter does
    print(os.environ["RANK"], os.environ.get("ONLY_HERE"), sys.argv[1:], os.getppid() != os.getpid(),
          numpy.random.randint(1 << 30), flush=True)
    what = sys.argv[1]
    if what == "raise":
        raise ValueError("boom from the script")
    if what == "exit":
        sys.exit(3)
    if what == "sleep":
        time.sleep(60)
    if what == "orphan":  # as if its death signal were lost: only the zygote's own cleanup can end it
        import ctypes
        ctypes.CDLL(None).prctl(1, 0)  # PR_SET_PDEATHSIG, none
        print("orphan ready", flush=True)
        time.sleep(60)
    """
)


def _started(tmp_path, *args: str) -> tuple[Zygote, dict[str, str]]:
    """A started zygote for ``SCRIPT`` (with ``args``) and rank 0's environment."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, RANK="0", PYTHONPATH=os.pathsep.join(sys.path))
    zygote = Zygote(["-u", "-m", "loom.launch.worker", str(script), *args], env)
    zygote.enabled = True
    zygote.start()
    return zygote, env


def _run(zygote: Zygote, env: dict[str, str], what: str) -> tuple[int, str, str, object]:
    zygote.args = [zygote.args[0], what]
    proc = zygote.fork(env)
    assert proc is not None, "the zygote did not fork"
    if what == "sleep":
        proc.stdout.readline()
        os.kill(proc.pid, signal.SIGTERM)  # as the launcher stops a worker (supervise.stop_processes)
    code = proc.wait(timeout=60)
    return code, proc.stdout.read(), proc.stderr.read(), proc


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_forked_workers_behave_as_fresh_ones(tmp_path):
    zygote, env = _started(tmp_path)
    try:
        code, out, err, proc = _run(zygote, dict(env, RANK="5", ONLY_HERE="yes"), "ok")
        lines = out.splitlines()
        assert code == 0, err
        assert lines[0].startswith("5 yes ['ok'] True"), out
        assert lines[1:] == ["thread joined", "atexit ran"], out
        assert proc.pid != zygote.proc.pid
        code, out2, err, _ = _run(zygote, dict(env, RANK="1"), "raise")
        assert code == 1 and "ValueError: boom from the script" in err and "Traceback" in err, err
        assert out.split()[-1] != out2.splitlines()[0].split()[-1], (
            "numpy's global generator was not reseeded"
        )
        code, _, err, _ = _run(zygote, dict(env, RANK="2"), "exit")
        assert code == 3, err
        code, _, _, _ = _run(zygote, dict(env, RANK="3"), "sleep")
        assert code == -signal.SIGTERM
        assert zygote.fork(dict(env, LOOM_ANYTHING="x")) is not None  # not a startup variable
        assert zygote.fork(dict(env, PYTHONHASHSEED="7")) is None  # the interpreter read it: a fresh one
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0
    assert zygote.fork(env) is None  # gone: the launcher starts fresh interpreters


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_worker_still_running_when_the_launcher_ends_the_zygote_is_killed_with_its_session(tmp_path):
    zygote, env = _started(tmp_path, "orphan")
    proc = zygote.fork(env, new_session=True)
    assert proc is not None
    while "orphan ready" not in proc.stdout.readline():  # (the script's first line comes before)
        pass
    zygote.close()  # the launcher's end: the zygote ends what it forked and has not reaped
    deadline = time.monotonic() + 20
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(proc.pid), "a forked worker outlived its zygote"
    assert zygote.proc.returncode == 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_dead_zygote_forks_nothing_and_its_workers_count_as_killed(tmp_path):
    zygote, env = _started(tmp_path, "sleep")
    proc = zygote.fork(env)
    assert proc is not None
    proc.stdout.readline()
    zygote.proc.kill()
    zygote.proc.wait()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert zygote.fork(env) is None
    zygote.close()


@pytest.mark.unit
def test_off_means_no_process():
    zygote = Zygote(["-u", "-m", "loom.launch.worker", "x.py"], {})
    zygote.enabled = False
    zygote.start()
    assert zygote.proc is None and zygote.fork({}) is None


PARENT = textwrap.dedent(
    """
    import os, sys
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().replace(b"\\0", b" ").decode()
    print("rank", os.environ["RANK"], "parent", "zygote" if "loom.launch.zygote" in parent else "launcher",
          "own-session", os.getsid(0) == os.getpid(), flush=True)
    """
)


@pytest.mark.system
@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["restart", "continue"])
@pytest.mark.parametrize("zygote", ["1", "0"])
def test_loom_run_forks_its_workers_from_the_zygote_unless_turned_off(tmp_path, policy, zygote):
    from test_launcher import run_loom

    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    extra = [] if policy == "restart" else ["--on-worker-failure", "continue"]
    result = run_loom(["run", "-n", "2", *extra, script], tmp_path, timeout=150, env={"LOOM_ZYGOTE": zygote})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line.split(": ", 1)[1] for line in result.stdout.splitlines() if " parent " in line)
    parent = "zygote" if zygote == "1" else "launcher"
    session = policy == "restart"  # under stop each worker has a session of its own, as under torchrun
    assert lines == [f"rank {r} parent {parent} own-session {session}" for r in (0, 1)], result.stdout
