"""Run a loom training function or script on Spark, one process per barrier task, as ``TorchDistributor`` does.

Usage, ``local_mode`` and the job secret's path (made per run by task 0, shared through the barrier's
``allGather``, handed to each worker on stdin: never in a command line, a file, a log or the Spark worker's
environment, which later tasks reuse): docs/launching.md ("Spark"). Each task starts one worker with loom's
environment (``RANK`` = its partition, ``LOCAL_RANK`` among the tasks on its host, ``MASTER_ADDR``/``MASTER_PORT``
= task 0's host and store, ``GLOO_SOCKET_IFNAME`` = the interface holding the task's address), so `loom.init`
meets the others in loom's authenticated store, hosted by task 0 for the stage's lifetime (on 127.0.0.1 when every
task runs on one host). A function, its arguments and rank 0's result cross as cloudpickle through files in a
private 0700 folder on the worker's host; a script must exist at the same path on every executor. Needs
``pyspark`` (``loom-train[spark]``) and the classic API (``RDD.barrier``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import secrets
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from loom.errors import check_int
from loom.launch.supervise import pump

__all__ = ["run"]

_TAIL_LINES = 40


def run(
    train: Callable[..., Any] | str,
    *args: Any,
    num_processes: int = 1,
    local_mode: bool = True,
    spark: Any = None,
    run_dir: str | Path | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``train(*args, **kwargs)`` (a function) or ``python train *args`` (a script path) as ``num_processes``
    loom ranks; returns rank 0's return value of a function, None for a script.

    ``local_mode``: True runs the ranks on the driver (`loom run`); False, one per task of a Spark barrier
    stage on ``spark`` (default: the active session). ``run_dir``: ``LOOM_RUN_DIR`` of every rank (logs,
    step records; a path every executor can write for ``local_mode=False``); default: none for barrier tasks,
    a temporary folder removed afterwards for ``local_mode=True``.
    """
    check_int("num_processes", num_processes)
    if isinstance(train, str):
        if kwargs:
            raise TypeError(
                f"a script takes command-line arguments only; got keyword arguments {sorted(kwargs)}"
            )
        if not Path(train).is_file():
            raise FileNotFoundError(f"training script {train!r} does not exist")
        train = str(Path(train).resolve())
    elif not callable(train):
        raise TypeError(f"train must be a function or a script path, got {type(train).__name__}")
    if local_mode:
        return _run_on_driver(train, args, kwargs, num_processes, run_dir)
    return _run_on_barrier_tasks(train, args, kwargs, num_processes, spark, run_dir)


# -- local_mode=True: `loom run -n N` on the driver ---------------------------------------------------------
def _run_on_driver(train, args, kwargs, num_processes: int, run_dir) -> Any:
    import cloudpickle

    with tempfile.TemporaryDirectory(prefix="loom-spark-") as private:
        run_dir = Path(run_dir) if run_dir is not None else Path(private, "run")
        cmd = [sys.executable, "-u", "-m", "loom.cli", "run", "-n", str(num_processes),
               "--run-dir", str(run_dir)]  # fmt: skip
        if isinstance(train, str):
            cmd += [train, *map(str, args)]
        else:
            call, result = Path(private, "call.pkl"), Path(private, "result.pkl")
            call.write_bytes(cloudpickle.dumps((train, args, kwargs)))
            cmd += ["-m", "loom.launch.spark", "--call", str(call), "--result", str(result)]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        _stream(proc, "", "loom run")
        return None if isinstance(train, str) else cloudpickle.loads(result.read_bytes())


def _stream(proc: subprocess.Popen, prefix: str, what: str) -> None:
    """Copy ``proc``'s output to ours (each line after ``prefix``); raise naming ``what`` if it fails."""
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    try:
        assert proc.stdout is not None
        pump(proc.stdout, prefix, tail=tail)
        status = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if status != 0:
        raise RuntimeError(
            f"loom.spark: {what} failed with exit status {status}; its last lines:\n{''.join(tail)}"
        )


# -- local_mode=False: one rank per barrier task ------------------------------------------------------------
def _run_on_barrier_tasks(train, args, kwargs, num_processes: int, spark, run_dir) -> Any:
    import cloudpickle
    from pyspark.sql import SparkSession

    session = spark if spark is not None else SparkSession.getActiveSession()
    if session is None:
        raise ValueError("local_mode=False needs a SparkSession: pass spark= or create one first")
    conf = session.sparkContext.getConf()
    master = conf.get("spark.master", "")
    if not master.startswith("local") and conf.get("spark.network.crypto.enabled", "false") != "true":
        print("loom.spark: warning: spark.network.crypto.enabled is off, so the job secret crosses Spark's RPC "
              "unencrypted; set spark.authenticate and spark.network.crypto.enabled on a shared network",
              file=sys.stderr)  # fmt: skip
    payload = cloudpickle.dumps((train, args, kwargs)) if callable(train) else None
    script = None if callable(train) else (train, [str(a) for a in args])
    task = _barrier_task(payload, script, num_processes, None if run_dir is None else str(run_dir))
    rdd = session.sparkContext.parallelize(range(num_processes), num_processes)
    results = rdd.barrier().mapPartitions(task).collect()
    return None if payload is None else cloudpickle.loads(results[0])


def _barrier_task(payload: bytes | None, script, num_processes: int, run_dir: str | None):
    """The function each barrier task runs (shipped by Spark; everything it needs is in its closure)."""

    def task(_: Iterator[int]) -> Iterator[bytes]:
        from pyspark import BarrierTaskContext

        from loom.net.interfaces import interface_of
        from loom.net.store import StoreServer

        context = BarrierTaskContext.get()
        rank = context.partitionId()
        hosts = [info.address.rsplit(":", 1)[0] for info in context.getTaskInfos()]
        if len(hosts) != num_processes:
            raise RuntimeError(f"loom.spark: rank {rank}: the barrier stage has {len(hosts)} tasks, "
                               f"expected {num_processes}")  # fmt: skip
        # One host (Spark's local mode, or a cluster that placed every task on one executor host): everything
        # listens on loopback, as under `loom run`, never on the address Spark's driver advertises.
        addresses = ["127.0.0.1"] * len(hosts) if len(set(hosts)) == 1 else hosts
        server = None
        note = ""
        if rank == 0:
            secret = secrets.token_hex(32)
            server = StoreServer(addresses[0], 0, bytes.fromhex(secret))
            note = json.dumps(
                {"port": server.port, "secret": secret, "prefix": f"loom-spark-{uuid.uuid4().hex}/"}
            )
        try:
            shared = json.loads(context.allGather(note)[0])
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(num_processes),
                LOCAL_RANK=str(hosts[:rank].count(hosts[rank])),
                LOCAL_WORLD_SIZE=str(hosts.count(hosts[rank])),
                MASTER_ADDR=addresses[0],
                MASTER_PORT=str(shared["port"]),
                LOOM_STORE_PREFIX=shared["prefix"],
                PYTHONUNBUFFERED="1",
            )
            env.setdefault("OMP_NUM_THREADS", "1")
            env.pop("LOOM_JOB_SECRET", None)
            interface = interface_of(addresses[rank]) if sys.platform.startswith("linux") else None
            if interface is not None:
                env["GLOO_SOCKET_IFNAME"] = interface
            if run_dir is not None:
                env["LOOM_RUN_DIR"] = run_dir
            result = _run_worker(rank, payload, script, env, shared["secret"])
            context.barrier()  # task 0 keeps the store until every worker is done with it
        finally:
            if server is not None:
                server.close()
        if rank == 0 and result is not None:
            yield result

    return task


def _run_worker(rank: int, payload: bytes | None, script, env: dict[str, str], secret: str) -> bytes | None:
    """Start this task's worker, hand it the secret on stdin, stream its output; rank 0's pickled result."""
    with tempfile.TemporaryDirectory(prefix="loom-spark-") as private:
        worker = ["-m", "loom.launch.worker", "-m", "loom.launch.spark", "--secret-on-stdin"]
        cmd = [sys.executable, "-u", *worker]
        result = Path(private, "result.pkl")
        if payload is not None:
            call = Path(private, "call.pkl")
            call.write_bytes(payload)
            cmd += ["--call", str(call), "--result", str(result)]
        else:
            cmd += ["--script", script[0], *script[1]]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", env=env,
        )  # fmt: skip
        assert proc.stdin is not None
        try:
            proc.stdin.write(secret + "\n")
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the worker died at start; _stream reports its status and output
        _stream(proc, f"[rank{rank}]: ", f"rank {rank}'s worker")
        return result.read_bytes() if payload is not None and rank == 0 else None


# -- the worker process: python -m loom.launch.worker -m loom.launch.spark ... ----------------------------
def _worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loom.launch.spark", description="a loom.spark worker (internal)"
    )
    parser.add_argument("--secret-on-stdin", action="store_true")
    parser.add_argument("--call", type=Path)
    parser.add_argument("--result", type=Path)
    parser.add_argument("--script")
    ns, rest = parser.parse_known_args(argv)
    if ns.secret_on_stdin:
        from loom.net.store import job_secret

        line = sys.stdin.readline(1024).strip()
        job_secret(line)  # raises, without echoing it, unless it is a proper secret
        os.environ["LOOM_JOB_SECRET"] = line
    if ns.script is not None:
        from loom.launch.worker import run_target

        return run_target([ns.script, *rest])
    import cloudpickle

    function, args, kwargs = cloudpickle.loads(ns.call.read_bytes())
    value = function(*args, **kwargs)
    if os.environ.get("RANK", "0") == "0":
        partial = ns.result.with_suffix(".partial")
        partial.write_bytes(cloudpickle.dumps(value))
        partial.replace(ns.result)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
