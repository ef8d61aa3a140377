"""The warm pool's ranks behave as ``python script.py args`` would: what the script sees (``__name__``, argv,
``sys.path[0]``, working directory, environment, stdin, its own session), its output, and its exit status
(a code, an uncaught exception, a signal), each compared with the same script run by `subprocess.Popen`; and
the same for ``python -m module``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import WARM_POOL, _kill_group
from warm_pool import WarmPool

SCRIPT = textwrap.dedent(
    """
    import json, os, random, sys, atexit
    how = sys.argv[1]
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps({"name": __name__, "argv0": sys.argv[0], "argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(),
                      "env": os.environ.get("WARM_POOL_PROBE"), "stdin": sys.stdin.read(),
                      "own_session": os.getsid(0) == os.getpid(),
                      "random": random.random()}))
    print("to stderr", file=sys.stderr)
    if how == "code":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError("the script's own error")
    if how == "signal":
        os.kill(os.getpid(), 15)
    """
)


def _run(kind: str, script: Path, tmp_path: Path, how: str, as_module: bool) -> tuple[int, str, str]:
    out, err = open(tmp_path / f"{kind}-{how}.out", "w+"), open(tmp_path / f"{kind}-{how}.err", "w+")  # noqa: SIM115
    env = dict(os.environ, WARM_POOL_PROBE=how, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", script.stem, how] if as_module else [sys.executable, str(script), how]
    cwd = script.parent if as_module else tmp_path
    if kind == "pool":
        assert WARM_POOL.usable(env), "the pool should stand in for this environment"
        proc = WARM_POOL.spawn(cmd, env=env, stdout=out, stderr=err, cwd=cwd)
    else:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=cwd, start_new_session=True,
                                stdin=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"{kind} {how} did not finish"
            time.sleep(0.02)
    finally:
        _kill_group(proc)
    out.seek(0), err.seek(0)
    return proc.returncode, out.read(), err.read()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(os.environ.get("LOOM_WARM_POOL") == "0", reason="LOOM_WARM_POOL=0 turns the pool off")
@pytest.mark.parametrize(
    ("as_module", "how"),
    [(False, "ok"), (False, "code"), (False, "raise"), (False, "signal"), (True, "code")],
    ids=["script-ok", "script-code", "script-raise", "script-signal", "module-code"],
)
def test_a_pool_rank_sees_and_ends_as_a_fresh_interpreter_would(tmp_path, how, as_module):
    script = tmp_path / "probe" / "warm_pool_probe.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    runs = {kind: _run(kind, script, tmp_path, how, as_module) for kind in ("fresh", "pool")}
    (fresh_code, fresh_out, fresh_err), (pool_code, pool_out, pool_err) = runs["fresh"], runs["pool"]
    assert pool_code == fresh_code == {"ok": 0, "code": 3, "raise": 1, "signal": -15}[how], runs
    fresh, pool = json.loads(fresh_out.splitlines()[0]), json.loads(pool_out.splitlines()[0])
    # a fork reseeds `random` (os.register_at_fork), as each fresh interpreter seeds its own
    assert pool.pop("random") != fresh.pop("random")
    want = dict(fresh, name="__main__", argv0=str(script), argv=[how], path0=str(script.parent),
                cwd=str(script.parent if as_module else tmp_path), env=how, stdin="", own_session=True)  # fmt: skip
    assert pool == fresh == want, runs
    assert ("atexit ran" in pool_out) == ("atexit ran" in fresh_out) == (how != "signal"), runs
    assert pool_err.startswith("to stderr") and fresh_err.startswith("to stderr"), runs
    if how == "raise":
        assert "RuntimeError: the script's own error" in pool_err.splitlines()[-1], pool_err
        assert "RuntimeError: the script's own error" in fresh_err.splitlines()[-1], fresh_err


@pytest.mark.unit
def test_a_different_startup_environment_gets_a_zygote_of_its_own():
    """Variables read at interpreter or torch start choose the zygote (made here, not started); others do not."""
    pool = WarmPool()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    first = pool.zygote_for(env)
    assert pool.zygote_for(dict(env, LOOM_HANG_TIMEOUT_S="5", RANK="1")) is first
    others = [
        pool.zygote_for(dict(env, OMP_NUM_THREADS="2")),
        pool.zygote_for(dict(env, PYTHONUNBUFFERED="x")),
    ]
    assert len({id(z) for z in [first, *others]}) == 3
    pool.zygote_for(dict(env, PYTHONHASHSEED="7"))
    assert pool.zygote_for(dict(env, PYTHONHASHSEED="8")) is None  # past MAX_ZYGOTES: a fresh interpreter
