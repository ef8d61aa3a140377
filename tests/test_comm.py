"""loom.comm: every all-reduce algorithm equals native and a one-process reference; bytes are counted exactly."""

import json

import pytest
import torch
from conftest import run_workers

from loom import comm


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N={n}")
def check_run(request) -> tuple[int, list[dict]]:
    """One launch of comm_check.py per world size, shared by the tests that read its output."""
    n = request.param
    outputs = run_workers("comm_check.py", n, timeout=50)
    return n, [json.loads(out.strip().splitlines()[-1]) for out in outputs]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_algorithms_match_native_and_reference(check_run):
    _, results = check_run
    failures = [f for result in results for f in result["failures"]]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_bytes_ring_and_driver_exact(check_run):
    n, results = check_run
    d = 60 * 4  # comm_check.py's float32 tensor of 60 elements
    for rank, result in enumerate(results):
        counted = result["bytes"]
        ring = 2 * (n - 1) * d // n
        assert counted["ring"] == {"bytes_sent": ring, "bytes_received": ring, "ops": {"ring": 1}}, rank
        assert counted["native"] == {"bytes_sent": ring, "bytes_received": ring, "ops": {"native": 1}}, rank
        driver = (n - 1) * d if rank == 0 else d
        assert counted["driver"] == {"bytes_sent": driver, "bytes_received": driver, "ops": {"driver": 1}}, (
            rank
        )


@pytest.mark.system
@pytest.mark.timeout(60)
def test_ring_runs_over_loom_links(check_run):
    """With the job secret (the harness hands one out, as `loom run` does) every process has its two
    authenticated sockets, and nobody else connected."""
    _, results = check_run
    assert [r["ring_sockets"] for r in results] == [{"linked": True, "rejected": 0}] * len(results)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_group_uses_group_ranks(check_run):
    n, results = check_run
    if n < 3:
        pytest.skip("a proper subgroup needs 3 or more processes")
    d, size = 60 * 4, n - 1
    assert results[0]["group"] == {}
    for result in results[1:]:
        group = result["group"]
        assert group["size"] == size
        ring = 2 * (size - 1) * d // size
        assert group["bytes"]["ring"]["bytes_sent"] == ring
        driver = (size - 1) * d if group["group_rank"] == 0 else d
        assert group["bytes"]["driver"]["bytes_sent"] == driver


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_ddp_hook_matches_native_gradients(workers):
    (result, *_) = [json.loads(out.strip().splitlines()[-1]) for out in workers("comm_ddp.py", 2, timeout=50)]
    reference = torch.tensor(result["reference"])
    without_hook = torch.tensor(result["runs"]["none"]["grads"])
    torch.testing.assert_close(without_hook, reference, rtol=1e-6, atol=1e-7)
    for algorithm in comm.ALGORITHMS:
        run = result["runs"][algorithm]
        torch.testing.assert_close(torch.tensor(run["grads"]), without_hook, rtol=1e-6, atol=1e-7)
        assert run["counters"]["ops"].get(algorithm, 0) >= 1, algorithm
    # With 2 processes the ring sends exactly half of every bucket twice: all gradient bytes once.
    assert result["runs"]["ring"]["counters"]["bytes_sent"] == result["param_bytes"]


@pytest.mark.unit
@pytest.mark.timeout(10)
@pytest.mark.parametrize("algorithm", ["native", "ring", "driver"])
def test_one_process_is_a_no_op(algorithm):
    comm.counters().reset()
    t = torch.arange(6.0).view(2, 3).t()
    expected = t.clone()
    assert comm.all_reduce(t, "avg", algorithm) is t
    assert torch.equal(t, expected)
    assert comm.counters().snapshot() == {"bytes_sent": 0, "bytes_received": 0, "ops": {algorithm: 1}}
    comm.counters().reset()
    assert comm.counters().snapshot() == {"bytes_sent": 0, "bytes_received": 0, "ops": {}}


@pytest.mark.unit
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"op": "mean"}, ValueError, ["'mean'", "'sum'", "'avg'", "'max'", "'min'"]),
        ({"algorithm": "tree"}, ValueError, ["'tree'", "'native'", "'ring'", "'driver'"]),
        ({"op": "avg", "tensor": torch.ones(2, dtype=torch.int64)}, ValueError, ["torch.int64", "HINT"]),
        ({"tensor": torch.ones(2, dtype=torch.bool)}, TypeError, ["torch.bool"]),
        ({"tensor": [1.0, 2.0]}, TypeError, ["list"]),
    ],
)
def test_bad_arguments_are_named(kwargs, error, names):
    kwargs = {"tensor": torch.ones(2), **kwargs}
    with pytest.raises(error) as raised:
        comm.all_reduce(**kwargs)
    for name in names:
        assert name in str(raised.value)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_hook_rejects_unknown_algorithm():
    with pytest.raises(ValueError, match="'tree'"):
        comm.allreduce_hook("tree")
