"""ParameterServer against live servers: sync equals one process, async converges, ssp bounds the lead, faults.

Two servers are started once for the module; each run uses its own model namespace on them (runs on 1 server
use server 0 or 1, runs on 2 servers both). Each worker process does several runs one after the other, to keep
the number of process starts (each imports torch) small on this 2-core machine; the fault-injection runs come
last, since they kill a worker.
"""

import os
from pathlib import Path

import pytest
import torch
from ps_helpers import parameter_servers, run_ps_workers
from torch import nn
from workers.common import least_squares, make_dataset, make_mlp, make_optimizer, reference_run

from loom.ps.client import PSClient
from loom.ps.wire import MessageType, secret_from_hex

pytestmark = pytest.mark.multiprocess

STEPS, GLOBAL_BATCH = 10, 10
SYNC_RUNS = [
    {"mode": "sync", "optimizer": opt, "servers": servers, "steps": STEPS, "global_batch": GLOBAL_BATCH}
    for servers in ([0], [0, 1])
    for opt in ("sgd", "adam")
]


@pytest.fixture(scope="module")
def cluster():
    with parameter_servers(2) as servers:
        yield servers


def server_stats(servers, index: int) -> dict:
    client = PSClient([servers.addresses[index]], secret_from_hex(servers.secret))
    try:
        client.hello()
        return client.request(MessageType.STATS, [{}], timeout_s=30)[0].meta
    finally:
        client.close()


def lsq_loss(weight: list[float]) -> float:
    x, y = least_squares().tensors  # the problem of workers/ps_train.py
    return nn.functional.mse_loss(x @ torch.tensor(weight).view(8, 1), y).item()


def check_sync_runs(outputs: dict, world_size: int) -> None:
    refs = {opt: reference_run(opt, GLOBAL_BATCH, STEPS) for opt in ("sgd", "adam")}
    for rank, runs in outputs.items():
        for run in runs[: len(SYNC_RUNS)]:
            spec = SYNC_RUNS[run["run"]]
            label = (
                f"{world_size} workers, rank {rank}, {spec['optimizer']} on {len(spec['servers'])} servers"
            )
            assert run["error"] is None, label
            ref_losses, ref_params = refs[spec["optimizer"]]
            assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True)) <= 1e-5, label
            for name, ref in ref_params.items():
                got = torch.tensor(run["params"][name]).view_as(ref)
                assert (got - ref).abs().max().item() <= 1e-5, f"{label}: {name}"
            assert run["staleness"] == {"0": STEPS}, label  # sync: every gradient applied to its own version


@pytest.fixture(scope="module")
def three_workers(cluster, tmp_path_factory):
    """Job A, 3 workers: 4 sync runs; async and ssp (one worker slowed) on least squares; then rank 2 kills
    itself in an async run, and an ssp run follows without it."""
    runs = [
        *SYNC_RUNS,
        # every worker set up before any trains, paced: others' pushes land between a pull and its push (without
        # it, a loaded CI once ran the three one after another: every staleness 0)
        {"mode": "async", "problem": "lsq", "steps": 40, "global_batch": 48, "lr": 0.05,
         "barrier_dir": str(tmp_path_factory.mktemp("async_start")), "pace_s": 0.005},
        {"mode": "ssp", "staleness": 2, "problem": "lsq", "steps": 20, "global_batch": 48, "servers": [1],
         "slow_rank": 0, "slow_s": 0.05},
        {"mode": "async", "problem": "lsq", "steps": 30, "global_batch": 48, "kill_rank": 2, "kill_step": 5},
        # rank 2 is dead from the start of this run: ssp waits for it for timeout_s, then goes on without it
        {"mode": "ssp", "staleness": 1, "problem": "lsq", "steps": 10, "global_batch": 48, "servers": [1],
         "timeout_s": 2.0},
    ]  # fmt: skip
    config = {"tag": "A", "runs": runs}
    return run_ps_workers("ps_train.py", 3, config, cluster.env, timeout=80, may_die=frozenset({2}))


@pytest.mark.timeout(120)
def test_sync_three_workers_match_one_process(three_workers):
    check_sync_runs(three_workers, 3)


@pytest.mark.timeout(120)
def test_async_converges_and_staleness_reflects_workers(cluster, three_workers):
    runs = [three_workers[r][4] for r in range(3)]
    assert all(run["error"] is None for run in runs)
    assert lsq_loss(runs[0]["params"]["weight"]) < 0.02 * lsq_loss([0.0] * 8) + 1e-3
    histogram: dict[int, int] = {}
    for run in runs:
        for stale, count in run["staleness"].items():
            histogram[int(stale)] = histogram.get(int(stale), 0) + count
    assert sum(histogram.values()) == 3 * 40  # one staleness per update, all of them recorded
    mean = sum(s * c for s, c in histogram.items()) / sum(histogram.values())
    assert 0 < mean <= 2 * (3 - 1), histogram  # others' updates land between a pull and its push
    server = server_stats(cluster, 0)["models"]["A-4"]
    assert {int(k): v for k, v in server["staleness_histogram"].items()} == histogram
    assert server["version"] == 3 * 40
    # Each step's record carries the staleness of its update: the histogram, step by step.
    records = [s for run in runs for s in run["record_staleness"]]
    assert len(records) == 3 * 40 and all(s is not None for s in records)
    assert sorted(records) == sorted(float(s) for s, c in histogram.items() for _ in range(c))
    assert 0 < sum(records) / len(records) <= 2 * (3 - 1)


@pytest.mark.timeout(120)
def test_ssp_never_runs_more_than_s_ahead(cluster, three_workers):
    staleness = 2
    for rank in range(3):
        run = three_workers[rank][5]
        assert run["error"] is None
        leads = [clock - slowest for clock, slowest in run["clocks"]]
        assert len(leads) == 20 and max(leads) <= staleness, (rank, run["clocks"])
    server = server_stats(cluster, 1)["models"]["A-5"]
    assert all(clock - slowest <= staleness for _, clock, slowest in server["grants"])
    assert server["max_lead"] == staleness  # the slowed worker made the others reach the bound and wait


SCHEDULED_RUNS = [
    {"mode": "sync", "optimizer": "sgd", "servers": [0, 1], "steps": 7, "global_batch": GLOBAL_BATCH,
     "scheduler": scheduler}
    for scheduler in ("step", "lambda")
]  # fmt: skip


@pytest.fixture(scope="module")
def two_workers(cluster):
    """Job B, 2 workers: the sync runs, two runs with a learning-rate scheduler, then rank 1 kills itself in a
    sync run."""
    failing = {"mode": "sync", "steps": STEPS, "global_batch": GLOBAL_BATCH, "kill_rank": 1, "kill_step": 3,
               "timeout_s": 2.0}  # fmt: skip
    config = {"tag": "B", "runs": [*SYNC_RUNS, *SCHEDULED_RUNS, failing]}
    return run_ps_workers("ps_train.py", 2, config, cluster.env, timeout=80, may_die=frozenset({1}))


@pytest.mark.timeout(120)
def test_sync_two_workers_and_failure_names_the_worker(two_workers):
    check_sync_runs(two_workers, 2)
    last = two_workers[0][-1]
    assert last["run"] == len(SYNC_RUNS) + len(SCHEDULED_RUNS) and len(last["losses"]) == 3
    assert "worker 1" in last["error"], last["error"]


def scheduled_reference(scheduler: str, steps: int):
    """One process, whole global batches, the scheduler stepped after every optimizer step."""
    from loom.data import GlobalBatchSampler

    data, model = make_dataset(), make_mlp()
    opt = make_optimizer("sgd", model)
    if scheduler == "step":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=1)
    losses: list[float] = []
    while len(losses) < steps:
        for batch in sampler:
            x, y = data[batch.indices]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
def test_worker_lr_scheduler_drives_the_servers(two_workers):
    """A StepLR / LambdaLR stepped on each worker's optimizer gives one process's parameters (sync, 2 servers)."""
    for index, spec in enumerate(SCHEDULED_RUNS, start=len(SYNC_RUNS)):
        ref_losses, ref_params = scheduled_reference(spec["scheduler"], spec["steps"])
        _, constant_params = reference_run("sgd", GLOBAL_BATCH, spec["steps"])
        for rank in (0, 1):
            run = two_workers[rank][index]
            label = f"{spec['scheduler']}, rank {rank}"
            assert run["run"] == index and run["error"] is None, label
            assert run["losses"] == pytest.approx(ref_losses, abs=1e-5), label
            for name, ref in ref_params.items():
                got = torch.tensor(run["params"][name]).view_as(ref)
                assert (got - ref).abs().max().item() <= 1e-5, f"{label}: {name}"
        # the schedule matters: without it the parameters differ by far more than the tolerance
        assert max((constant_params[n] - ref_params[n]).abs().max().item() for n in ref_params) > 1e-3


def _processes_with(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.timeout(120)
def test_killed_worker_does_not_stop_async_or_ssp(cluster, three_workers):
    assert [r["run"] for r in three_workers[2]] == [0, 1, 2, 3, 4, 5]  # SIGKILLed in run 6
    for rank in (0, 1):
        assert [len(r["losses"]) for r in three_workers[rank][6:]] == [30, 10]
        assert all(r["error"] is None for r in three_workers[rank][6:])
    assert lsq_loss(three_workers[0][6]["params"]["weight"]) < 0.05 * lsq_loss([0.0] * 8)
    assert "worker 2 silent" in cluster.log(1) and "no longer waits" in cluster.log(1)
    assert server_stats(cluster, 0)["models"]["A-6"]["version"] == 2 * 30 + 5  # servers are still up
    assert _processes_with('"tag": "A"') == []
    assert all(p.poll() is None for p in cluster.procs)
