"""loom.comm shm, hierarchical and auto: results, bytes, segment lifetime, calibration.

The matrix of every algorithm against native on one host is in test_comm.py (comm_check.py iterates over
`comm.ALGORITHMS`); here: the same matrix across two pretended hosts, tensors in many pieces, exact shm bytes,
and that no shared-memory segment outlives its job or is ever opened by another one.
"""

import json
import os
import subprocess
import time

import pytest
import torch
from conftest import run_workers

from loom import comm
from loom.comm import auto, shm
from loom.comm.shm_segment import PREFIX, SHM_DIR, STALE_AFTER_S, _sweep_stale

DATA_BYTES = 60 * 4  # comm_shm_check.py's float32 tensor of 60 elements


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("loom-cache")


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N={n}")
def check_run(request, cache_dir) -> tuple[int, list[dict]]:
    """One launch of comm_shm_check.py per world size, calibrating into a test cache directory."""
    n = request.param
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOOM_CACHE_DIR", str(cache_dir))
        outputs = run_workers("comm_shm_check.py", n, timeout=50)
    return n, [json.loads(out.strip().splitlines()[-1]) for out in outputs]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_results_match_native_across_pieces_and_fake_hosts(check_run):
    _, results = check_run
    failures = [f for result in results for f in result["failures"]]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_shm_bytes_exact(check_run):
    n, results = check_run
    d, bus = DATA_BYTES, 2 * (n - 1) * DATA_BYTES // n
    by_transport = {  # each process writes D and reads the ring's bus bytes, all through shared memory
        "shm": {
            "socket": {"bytes_sent": 0, "bytes_received": 0},
            "shm": {"bytes_sent": d, "bytes_received": bus},
        },
        "native": {
            "socket": {"bytes_sent": bus, "bytes_received": bus},
            "shm": {"bytes_sent": 0, "bytes_received": 0},
        },
    }
    by_transport["ring"] = by_transport["native"]
    for result in results:
        for algorithm in ("shm", "hierarchical", "auto"):
            chosen = result["auto_choice"] if algorithm == "auto" else "shm"
            counted = result["bytes"][algorithm]
            assert counted["ops"] == {algorithm: 1}
            assert {k: counted[k] for k in ("socket", "shm")} == by_transport[chosen], (algorithm, counted)
            sent = sum(t["bytes_sent"] for t in by_transport[chosen].values())
            assert (counted["bytes_sent"], counted["bytes_received"]) == (
                sent,
                sum(t["bytes_received"] for t in by_transport[chosen].values()),
            )


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_hierarchical_bytes_on_two_hosts(check_run):
    n, results = check_run
    d = DATA_BYTES
    hosts = [rank * 2 // n for rank in range(n)]
    for rank, result in enumerate(results):
        local = hosts.count(hosts[rank])
        counted = result["bytes"]["fake_hierarchical"]
        leader = hosts.index(hosts[rank]) == rank
        # Leaders: a ring of 2 hosts sends 2 (2-1)/2 * D each way; others: no socket traffic at all.
        socket = d if leader else 0
        assert counted["socket"] == {"bytes_sent": socket, "bytes_received": socket}, (rank, counted)
        if local == 1:
            expected_shm = (0, 0)
        elif leader:  # contributions + own chunk + the final result; others' contributions + their chunks
            expected_shm = (2 * d, 2 * (local - 1) * d // local)
        else:  # contributions + own chunk; others' contributions to its chunk + the final result
            expected_shm = (d, (local - 1) * d // local + d)
        assert (counted["shm"]["bytes_sent"], counted["shm"]["bytes_received"]) == expected_shm, (
            rank,
            counted,
        )


_NAMES_OF_EARLIER_JOBS: list[set[str]] = []


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_segments_unlinked_while_in_use_and_never_shared_between_jobs(check_run):
    n, results = check_run
    for result in results:
        assert result["linked"] == [], "a segment name was still in /dev/shm after set-up"
    names = {name for result in results for name in result["segments"]}
    hosts = [rank * 2 // n for rank in range(n)]
    shared_fake_hosts = sum(hosts.count(h) > 1 for h in (0, 1))
    # The default group (twice if it grew), the pieces group, one per pretended host with 2 processes or more.
    assert len(names) == 2 + results[0]["grew"] + shared_fake_hosts, names
    assert not any((SHM_DIR / name).exists() for name in names)
    assert not any(names & earlier for earlier in _NAMES_OF_EARLIER_JOBS), "a job reused an old segment name"
    _NAMES_OF_EARLIER_JOBS.append(names)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_auto_agrees_and_is_cached_per_topology(check_run, cache_dir):
    n, results = check_run
    assert len({json.dumps([r["policies"], r["auto_choices"]]) for r in results}) == 1, "ranks disagree"
    assert set(results[0]["auto_choices"]) <= {"native", "ring", "hierarchical"}
    entries = json.loads(next(cache_dir.glob("allreduce-*.json")).read_text())["entries"]
    per_host = "+".join(str([rank * 2 // n for rank in range(n)].count(h)) for h in (0, 1))
    assert {f"world={n},per_host={n}", f"world={n},per_host={per_host}"} <= set(entries)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid no longer exists
    return proc.pid


def _loom_names() -> set[str]:
    return {path.name for path in SHM_DIR.glob(PREFIX + "*")}


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_sigkilled_creator_leaves_no_segment(tmp_path):
    with pytest.raises(AssertionError, match="exited -9"):
        run_workers("comm_shm_lifecycle.py", 2, str(tmp_path), timeout=40)
    names = {(tmp_path / f"{rank}.name").read_text() for rank in range(2)}
    assert len(names) == 1
    assert not names & _loom_names()


@pytest.mark.multiprocess
@pytest.mark.timeout(10)
def test_stale_names_are_swept_only_when_old_and_orphaned():
    """What a creator killed between create and unlink leaves behind; the next job's creator sweeps it."""
    stale = SHM_DIR / f"{PREFIX}{_dead_pid()}-{'0' * 16}"
    recent = SHM_DIR / f"{PREFIX}{_dead_pid()}-{'1' * 16}"  # may still be in its set-up window
    alive = SHM_DIR / f"{PREFIX}{os.getpid()}-{'2' * 16}"
    try:
        for path in (stale, recent, alive):
            path.write_bytes(b"not a loom segment")
        old = time.time() - 2 * STALE_AFTER_S
        os.utime(stale, (old, old))
        os.utime(alive, (old, old))
        _sweep_stale()
        assert not stale.exists() and recent.exists() and alive.exists()
    finally:
        for path in (stale, recent, alive):
            path.unlink(missing_ok=True)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_attach_refuses_a_foreign_segment():
    segment = shm.Segment.create(2, 4096)
    forged = SHM_DIR / (segment.name[:-16] + "f" * 16)
    try:
        with pytest.raises(ValueError, match="expected"):
            shm.Segment.attach(segment.name, 3, 1, 4096)  # another layout than its creator's
        os.link(SHM_DIR / segment.name, forged)  # the same bytes under a name with another token
        with pytest.raises(ValueError, match="header"):
            shm.Segment.attach(forged.name, 2, 1, 4096)
    finally:
        forged.unlink(missing_ok=True)
        segment.unlink()


@pytest.mark.multiprocess
@pytest.mark.timeout(10)
def test_barrier_names_a_dead_peer():
    segment = shm.Segment.create(2, 4096)
    try:
        pid = os.fork()
        if pid == 0:  # the peer: attach (which records its pid), then die without a word
            shm.Segment.attach(segment.name, 2, 1, 4096)
            os._exit(0)
        os.waitpid(pid, 0)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"local process 1 \\(pid {pid}\\) exited"):
            segment.barrier()
        assert time.monotonic() - started < 1.0
    finally:
        segment.unlink()


@pytest.mark.unit
@pytest.mark.timeout(10)
@pytest.mark.parametrize("algorithm", ["shm", "hierarchical", "auto"])
def test_one_process_is_a_no_op(algorithm):
    comm.counters().reset()
    t = torch.arange(5.0)
    assert torch.equal(comm.all_reduce(t, "avg", algorithm), torch.arange(5.0))
    assert comm.counters().snapshot() == {"bytes_sent": 0, "bytes_received": 0, "ops": {algorithm: 1}}


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_policy_picks_the_fastest_at_the_nearest_size():
    policy = auto.Policy(("native", "shm"), (1024, 1 << 20), [[1.0, 1.0], [2.0, 0.5]])
    assert [policy.choose(b) for b in (1, 1024, 30_000, 40_000, 1 << 30)] == [
        "native",
        "native",
        "native",
        "shm",
        "shm",
    ]


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_calibration_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    names = ("native", "ring")
    table = [[1.0] * len(auto.CALIBRATION_SIZES), [2.0] * len(auto.CALIBRATION_SIZES)]
    assert auto._read_cache("world=2,per_host=2", names) is None
    auto._write_cache("world=2,per_host=2", names, table)
    assert auto.cache_path().parent == tmp_path
    assert auto._read_cache("world=2,per_host=2", names) == table
    assert auto._read_cache("world=2,per_host=2", ("native", "ring", "shm")) is None  # other candidates
    auto.cache_path().write_text("{not json")
    assert auto._read_cache("world=2,per_host=2", names) is None
    auto.cache_path().write_text('{"entries": {"world=2,per_host=2": [1]}}')  # an entry not an object: a miss
    assert auto._read_cache("world=2,per_host=2", names) is None
    auto.cache_path().write_text("[1, 2]")  # JSON, not an object: overwritten, not an AttributeError
    auto._write_cache("world=2,per_host=2", names, table)
    assert auto._read_cache("world=2,per_host=2", names) == table
