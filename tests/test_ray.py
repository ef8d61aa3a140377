"""loom on Ray: `loom run --backend ray`, `loom.ray.run_script` and `loom.ray.run` on a local Ray instance.

One instance for the module, started by `loom.ray.local` as the backend starts its own (no dashboard, loopback,
token authentication) with 1 CPU, joined by a second node (raylet) with the other CPU, so every 2-worker job
spans two nodes; stopped at the end, when the last test checks that no process of Ray or of the jobs is left. Every process the jobs start carries ``LOOM_TEST_TAG`` (the backend hands the
driver's LOOM_* variables to every rank and server), so a leftover rank or server would be found.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")

import loom.ray  # noqa: E402
from loom.cli import main as loom_main  # noqa: E402
from loom.ray.local import connect, disconnect, session_processes, tagged_processes  # noqa: E402

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))  # ray_jobs (its train pickled by reference) and common
from ray_jobs import reference_params, train  # noqa: E402

TAG = uuid.uuid4().hex
STATE: dict = {}


def add_second_node():
    """A second Ray node (raylet) joining the instance on this machine, with the other CPU: every 2-worker job
    of the module then spans two nodes, one rank each (as ``ray.cluster_utils.Cluster`` adds nodes)."""
    import ray
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(
        gcs_address=ray.get_runtime_context().gcs_address, node_ip_address="127.0.0.1", num_cpus=1, num_gpus=0,
        object_store_memory=150 << 20, min_worker_port=0, max_worker_port=0, include_log_monitor=False,
        node_manager_port=0, dashboard_agent_listen_port=None,
    )  # fmt: skip
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    deadline = time.monotonic() + 60
    while sum(n["Alive"] for n in ray.nodes()) < 2:
        assert time.monotonic() < deadline, "the second Ray node did not join within 60 s"
        time.sleep(0.2)
    return node


@pytest.fixture(scope="module")
def ray_instance():
    saved = {k: os.environ.get(k) for k in ("LOOM_TEST_TAG", "PYTHONPATH")}
    os.environ["LOOM_TEST_TAG"] = TAG
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(WORKERS), saved["PYTHONPATH"]) if p)
    STATE["sigterm"] = signal.getsignal(signal.SIGTERM)
    connection = connect(None, num_cpus=1)
    STATE["connection"] = connection
    try:
        STATE["second_node"] = add_second_node()
        yield connection
    finally:
        if STATE.get("second_node") is not None:
            STATE.pop("second_node").kill_all_processes(check_alive=False, allow_graceful=True)
        if STATE.get("connection") is not None:
            disconnect(connection)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def assert_params_equal(params: dict, reference: dict) -> None:
    assert sorted(params) == sorted(reference)
    for name, values in params.items():
        torch.testing.assert_close(torch.tensor(values), reference[name], atol=1e-5, rtol=0, msg=name)


RUNS = [
    {"strategy": "dp", "steps": 4, "global_batch": 10},
    {"strategy": "ps", "steps": 4, "global_batch": 10},
]


@pytest.fixture(scope="module")
def script_job(ray_instance, tmp_path_factory):
    """``loom run --backend ray -n 2 --servers 1 ray_jobs.py`` once: a DataParallel run, then a sync
    ParameterServer run in the same processes (starting them is the slow part)."""
    run_dir = tmp_path_factory.mktemp("script") / "run"
    out, err = io.StringIO(), io.StringIO()
    argv = ["run", "--backend", "ray", "-n", "2", "--servers", "1", "--run-dir", str(run_dir)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = loom_main([*argv, str(WORKERS / "ray_jobs.py"), json.dumps(RUNS)])
    assert status == 0, err.getvalue()[-3000:]
    return run_dir, out.getvalue()


@pytest.mark.system
@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", RUNS, ids=[r["strategy"] for r in RUNS])
def test_two_ray_workers_equal_one_process(script_job, run):
    """DataParallel, and ParameterServer(mode="sync") with its one server an actor too."""
    run_dir, out = script_job
    reference = reference_params(run)
    for rank in range(2):
        assert f"[rank{rank}]: rank {rank} finished 4 {run['strategy']} steps" in out
        result = json.loads((run_dir / f"result-{run['strategy']}-{rank}.json").read_text())
        assert result["rank"] == rank and result["steps"] == 4
        assert_params_equal(result["params"], reference)


@pytest.mark.system
@pytest.mark.timeout(120)
def test_the_run_directory_has_loom_runs_layout(script_job):
    """Two nodes, one rank each: the ranks' places; step records that `loom report` reads (it does); every
    process's log (the server's included)."""
    from loom.observe.report import load_records, write_report

    run_dir, _ = script_job
    placed = [json.loads((run_dir / f"result-dp-{rank}.json").read_text())["placed"] for rank in range(2)]
    assert [(p["GROUP_RANK"], p["LOCAL_RANK"], p["LOCAL_WORLD_SIZE"]) for p in placed] == [("0", "0", "1"),
                                                                                          ("1", "0", "1")]  # fmt: skip
    # one rank on the driver's node wrote here itself, the other on its node, copied here by the driver
    assert sorted(p["LOOM_RUN_DIR"] == str(run_dir.resolve()) for p in placed) == [False, True]
    records = load_records(run_dir)
    assert sorted(records) == [0, 1] and [r["step"] for r in records[0]] == [1, 2, 3, 4]
    assert write_report(run_dir).is_file()  # what `loom report RUN_DIR` writes
    for rank in range(2):
        assert "finished 4 ps steps" in (run_dir / f"logs/attempt_0/rank{rank}.stdout.log").read_text()
    assert (run_dir / "logs/server0.stderr.log").exists()


@pytest.mark.system
@pytest.mark.timeout(120)
def test_sigkilled_worker_actor_is_replaced_and_resumes_from_the_checkpoint(ray_instance, tmp_path, capsys):
    """Rank 1's actor process is SIGKILLed after step 5 of 8 (checkpoints every 2): a new group resumes from
    step 4 and ends where one process resumed from a copy of that checkpoint ends."""
    ckpt = tmp_path / "ckpt"
    cfg = {"strategy": "dp", "steps": 8, "global_batch": 10, "checkpoint_dir": str(ckpt), "every": 2,
           "kill_step": 5}  # fmt: skip
    run_dir = tmp_path / "run"  # copied from the ranks, as from other nodes
    private = set(Path(tempfile.gettempdir()).glob("loom-ray-rank*"))
    results = loom.ray.run(train, 2, args=(cfg,), max_failures=1, run_dir=run_dir, copy_run_dir=True)
    err = capsys.readouterr().err
    assert "worker rank 1: its Ray actor" in err and "died" in err, err[-3000:]
    assert "replacing the worker group (restart 1 of 1)" in err
    assert "finished on Ray in" in err and "2 worker(s), 1 restart(s)" in err
    assert set(Path(tempfile.gettempdir()).glob("loom-ray-rank*")) == private  # the dead actor's one too
    assert [(r["rank"], r["attempt"], r["resumed_from"], r["steps"]) for r in results] == [
        (0, 1, 4, 8),
        (1, 1, 4, 8),
    ]
    assert (run_dir / "logs/attempt_1/rank1.stderr.log").exists()
    from loom.observe.report import load_records

    records = load_records(run_dir)  # a killed rank's unflushed records are lost, as under `loom run`
    assert all({5, 6, 7, 8} <= {r["step"] for r in records[rank]} for rank in (0, 1)), records
    assert (run_dir / "logs/attempt_0/rank1.stdout.log").exists()
    # The reference: one process resumed from a copy of the step-4 checkpoint, run to step 8 without a fault.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copytree(ckpt / "step-00000004", alone / "step-00000004")
    (alone / "latest").write_text("step-00000004")
    try:
        reference = train(dict(cfg, checkpoint_dir=str(alone), kill_step=None))
    finally:
        loom.shutdown()
    assert reference["resumed_from"] == 4 and reference["steps"] == 8
    straight = reference_params(cfg)  # and all of it equals one process run straight through
    for result in results:
        assert_params_equal(result["params"], {k: torch.tensor(v) for k, v in reference["params"].items()})
        assert_params_equal(result["params"], straight)


@pytest.mark.system
@pytest.mark.timeout(60)
def test_nothing_is_left_after_ray_shuts_down(ray_instance):
    """Last in the module: stop the instance; no Ray process and no rank or server of the jobs remain, and the
    driver's SIGTERM handler is its own again."""
    connection = STATE.pop("connection")
    session = connection.session_dir
    assert session is not None and session_processes(session), "the instance should be running until now"
    STATE.pop("second_node").kill_all_processes(check_alive=False, allow_graceful=True)
    disconnect(connection)
    assert session_processes(session) == []
    assert tagged_processes("LOOM_TEST_TAG", TAG) == []
    assert signal.getsignal(signal.SIGTERM) is STATE["sigterm"]  # ray.init's handler is gone with it


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_copied_records_of_a_replaced_rank_follow_those_of_the_lost_one(tmp_path):
    """What the driver writes for files copied from other nodes: step records and logs are continued by the
    next incarnation of a rank, other files replaced; nothing lands outside the run directory."""
    from loom.ray.output import write_chunk

    first: dict[str, int] = {}
    write_chunk(tmp_path, first, "metrics/rank1.jsonl", 0, b'{"step": 1}\n')
    write_chunk(tmp_path, first, "metrics/rank1.jsonl", 12, b'{"step": 2}\n')
    write_chunk(tmp_path, first, "result.json", 0, b"old result")
    second: dict[str, int] = {}  # the replacement rank's copies start at offset 0 again
    write_chunk(tmp_path, second, "metrics/rank1.jsonl", 0, b'{"step": 3}\n')
    write_chunk(tmp_path, second, "result.json", 0, b"new")
    assert (tmp_path / "metrics/rank1.jsonl").read_bytes() == b'{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert (tmp_path / "result.json").read_bytes() == b"new"
    for bad in ("../escape.log", "/etc/passwd", ""):
        with pytest.raises(ValueError, match="outside the run directory"):
            write_chunk(tmp_path / "run", {}, bad, 0, b"x")


@pytest.mark.system
@pytest.mark.timeout(10)
def test_local_launcher_options_are_refused_with_the_ray_backend(tmp_path, capsys):
    script = tmp_path / "job.py"
    script.write_text("print('never runs')\n")
    assert (
        loom_main(["run", "--backend", "ray", "--nnodes", "2", "--master", "127.0.0.1:1", str(script)]) == 2
    )
    assert "--nnodes, --master do not apply to --backend ray" in capsys.readouterr().err
    assert loom_main(["run", "--address", "127.0.0.1:6379", str(script)]) == 2
    assert "HINT: add --backend ray" in capsys.readouterr().err
    with pytest.raises(ValueError, match="resources_per_worker needs a positive amount"):
        loom.ray.RayConfig(resources_per_worker={"CPU": 0})
    with pytest.raises(ValueError, match="Ray Client addresses are not supported"):
        connect("ray://head:10001")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_rank_layout_keeps_a_nodes_ranks_together_and_shares_its_gpus():
    from loom.ray.layout import rank_layout

    wheres = [{"node_id": "a", "gpus": ["3"]}, {"node_id": "b", "gpus": ["0"]}, {"node_id": "a", "gpus": ["1"]},
              {"node_id": "b", "gpus": ["1"]}, {"node_id": "a", "gpus": ["0"]}]  # fmt: skip
    layout = rank_layout(wheres)
    assert [(p["bundle"], p["node_index"], p["local_rank"], p["local_size"]) for p in layout] == [
        (4, 0, 0, 3), (2, 0, 1, 3), (0, 0, 2, 3), (1, 1, 0, 2), (3, 1, 1, 2),
    ]  # fmt: skip
    assert [p["visible_gpus"] for p in layout] == ["0,1,3"] * 3 + ["0,1"] * 2
    # rank r's own GPU is cuda:LOCAL_RANK among the visible ones
    for p in layout:
        assert p["visible_gpus"].split(",")[p["local_rank"]] == wheres[p["bundle"]]["gpus"][0]
    cpu_only = rank_layout([{"node_id": "a"}, {"node_id": "a"}])
    assert [(p["bundle"], p["local_rank"], p["visible_gpus"]) for p in cpu_only] == [
        (0, 0, None),
        (1, 1, None),
    ]


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_failure_blamed_is_the_cause_not_its_echo():
    from loom.ray.output import blame

    echo = (2, 100.5, "worker rank 0 failed (exit code 1): RuntimeError: Connection closed by peer")
    cause = (2, 100.2, "worker rank 1 failed (exit code 1): ValueError: bad value on purpose")
    assert blame([echo, cause]) == cause[2]  # the earlier of two exceptions
    killed = (1, 100.9, "worker rank 1 was killed by SIGKILL")
    assert blame([echo, killed]) == killed[2]  # a signal before an exception that followed it
    lost = (0, 101.0, "worker rank 2: its Ray actor on host died")
    assert blame([echo, killed, lost]) == lost[2]
