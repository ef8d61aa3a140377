"""The healing spare (`loom.launch.spare`): a process started ahead becomes a replacement when told, bounded."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from loom.launch.spare import MAX_REQUEST, Spare, _read_request, split_worker_args


@pytest.mark.unit
def test_worker_args_split_into_the_interpreters_options_and_the_workers():
    assert split_worker_args(["-u", "-m", "loom.launch.worker", "/x/train.py", "dp"]) == (
        ["-u"],
        ["/x/train.py", "dp"],
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    "line, error",
    [
        (b"x" * (MAX_REQUEST + 2) + b"\n", "over"),
        (json.dumps({"env": {"A": 1}, "argv": ["s.py"]}).encode() + b"\n", "env must map names to strings"),
        (json.dumps({"env": {}, "argv": []}).encode() + b"\n", "argv must be a non-empty list"),
    ],
)
def test_a_bad_request_is_refused_by_name(line, error):
    with pytest.raises(SystemExit, match=error):
        _read_request(io.BytesIO(line))


@pytest.mark.unit
def test_no_request_means_the_job_ended():
    assert _read_request(io.BytesIO(b"")) is None


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_spare_becomes_the_worker_with_its_environment_and_arguments(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\nprint(os.environ['RANK'], os.environ.get('ONLY_IN_REQUEST'), sys.argv[1:])\n"
    )
    env = dict(os.environ, RANK="0")
    spare = Spare(["-u", "-m", "loom.launch.worker", str(script), "a", "b"], env)
    spare.enabled = True
    spare.fill()
    first = spare.proc
    proc = spare.take(dict(env, RANK="5", ONLY_IN_REQUEST="yes"))
    assert proc is first and spare.proc is not None and spare.proc is not first  # the next spare is starting
    out = proc.stdout.read()  # (its stdin, the request's pipe, is closed already)
    assert proc.wait(timeout=100) == 0, proc.stderr.read()
    assert out.strip() == "5 yes ['a', 'b']"
    spare.close()
    assert spare.proc is None


@pytest.mark.multiprocess
def test_a_dead_spare_is_not_handed_out():
    spare = Spare(["-m", "loom.launch.worker", "x.py"], dict(os.environ))
    spare.proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, text=True)
    spare.proc.wait()
    spare.enabled = False  # no new spare either
    assert spare.take({}) is None
