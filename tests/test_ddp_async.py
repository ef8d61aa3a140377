"""The overlapped DDP hook: same gradients as DDP's own all-reduce, errors named, thread in FIFO order."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from loom.comm.ddp_async import overlapped_allreduce_hook
from loom.comm.thread import CommThread, comm_thread, torch_future


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_comm_thread_runs_jobs_in_order_off_the_caller_thread():
    thread, seen = CommThread(), []
    try:
        futures = [
            thread.submit(lambda i=i: (seen.append((i, threading.get_ident())), torch.tensor(i))[1])
            for i in range(20)
        ]
        assert [int(f.result()) for f in futures] == list(range(20))
        assert [i for i, _ in seen] == list(range(20))
        assert {ident for _, ident in seen} != {threading.get_ident()}
    finally:
        thread.stop()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="has stopped"):  # nothing would ever run it
        thread.submit(lambda: None)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_comm_thread_reports_failures_with_their_description():
    thread = CommThread()
    try:

        def fail() -> torch.Tensor:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):  # the call's own exception, in its future
            thread.submit(fail).result()
        failed = torch_future(thread.submit(fail), lambda: "rank 3: bucket 7")  # what a DDP hook returns
        with pytest.raises(RuntimeError, match="rank 3: bucket 7 failed: ValueError"):
            failed.wait()
        assert (
            int(torch_future(thread.submit(lambda: torch.tensor(5)), str).wait()) == 5
        )  # the thread survived
    finally:
        thread.stop()


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_process_has_one_shared_comm_thread():
    assert comm_thread() is comm_thread() and comm_thread().is_alive()


@pytest.mark.unit
def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="algorithm must be one of .*, got 'carrier-pigeon'"):
        overlapped_allreduce_hook("carrier-pigeon")


@pytest.mark.multiprocess
@pytest.mark.timeout(40)
def test_overlapped_hook_matches_ddp_on_two_processes(workers):
    outs = [json.loads(out.strip().splitlines()[-1]) for out in workers("ddp_async_exact.py", 2, timeout=35)]
    for rank, out in enumerate(outs):
        native = torch.tensor(out["runs"]["none"]["grads"])
        for name in ("shm", "auto", "ring"):
            run = out["runs"][name]
            got = torch.tensor(run["grads"])
            err = ((got - native).norm() / native.norm()).item()
            assert err <= 1e-6, f"rank {rank} {name}: relative error {err:.2e} vs DDP's own all-reduce"
            assert run["ops"].get(name, 0) >= 2, f"rank {rank} {name}: hook not used ({run['ops']})"
        assert "injected failure" in out["error"] and f"rank {rank}: overlapped all_reduce" in out["error"]
    assert outs[0]["runs"]["shm"]["grads"] == outs[1]["runs"]["shm"]["grads"]
