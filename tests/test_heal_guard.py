"""The guard's timeouts under heal (issue 39, item 2): a member lost under heal is replaced, not waited for, so
``hang_timeout_s`` bounds each collective of an epoch's group, ``work_timeout_s`` the launcher's wait for a
member's check-in and ``liveness_timeout_s`` its heartbeat (`loom.fault.quorum.Quorum.apply_guard`, read by
`loom.launch.heal.HealQuorum`); each one unset keeps heal's own setting. Before, they were refused under heal."""

from __future__ import annotations

import threading

import pytest
from test_heal import check_healed_job, run_heal
from test_heal_units import Launcher, MemoryStore

from loom.fault.quorum import Quorum, read_guard
from loom.train.guard import GuardOptions, set_timeouts


def _quorum(store: MemoryStore) -> Quorum:
    quorum = Quorum(store, rank=1, generation=2)
    quorum.close()  # no heartbeat thread needed here
    return quorum


@pytest.mark.unit
def test_the_timeouts_set_reach_the_quorum_and_unset_ones_keep_heals_own(monkeypatch):
    for name in ("LOOM_HANG_TIMEOUT_S", "LOOM_WORK_TIMEOUT_S", "LOOM_LIVENESS_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    assert set_timeouts(GuardOptions()) == (None, None, None)
    monkeypatch.setenv("LOOM_WORK_TIMEOUT_S", "40")
    assert set_timeouts(GuardOptions(hang_timeout_s=7)) == (7.0, 40.0, None)

    store = MemoryStore()
    quorum = _quorum(store)
    default_group = quorum.group_timeout_s
    quorum.apply_guard(None, None, None)
    assert quorum.group_timeout_s == default_group and not store.check(["guard/1/2"])
    quorum.apply_guard(7.0, 40.0, 3.0)
    assert quorum.group_timeout_s == 7.0
    assert read_guard(store.get("guard/1/2")) == {"work_s": 40.0, "liveness_s": 3.0}
    with pytest.raises(
        ValueError, match=r"liveness_timeout_s=0.5 under --on-worker-failure heal.*HINT: use at "
    ):
        quorum.apply_guard(None, None, 0.5)


@pytest.mark.unit
@pytest.mark.parametrize(
    "raw",
    [b"{", b"[1]", b'{"liveness_s": -1}', b'{"liveness_s": NaN}', b'{"liveness_s": true}', b'{"x": 3}',
     b'{"work_s": "3"}', b'{"work_s": 1e999}', b'{"work_s": 3' + b" " * 300 + b"}"],
)  # fmt: skip
def test_what_the_launcher_reads_of_a_workers_timeouts_is_bounded_and_checked(raw):
    assert read_guard(raw) == {}


def _started(job: Launcher) -> None:
    for r in range(3):
        job.ready(r)
    job.quorum.tick()
    assert job.members(1) == "0:0,1:0,2:0"


@pytest.mark.unit
def test_the_launcher_judges_a_heartbeat_by_the_liveness_timeout_the_worker_told(monkeypatch, capsys):
    monkeypatch.setenv("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", "60")
    job = Launcher()
    job.store.set("guard/1/0", '{"liveness_s": 0.05}')
    _started(job)
    for r in range(3):
        job.store.add(f"hb/{r}/0", 1)
    job.quorum.tick()
    threading.Event().wait(0.1)
    job.store.add("hb/0/0", 1)
    job.store.add("hb/2/0", 1)
    job.quorum.tick()
    assert job.running == {0: True, 1: False, 2: True}  # rank 2 keeps heal's 60 s
    assert "worker rank 1 sent no heartbeat for 0.05 s (liveness_timeout_s / LOOM_LIVENESS_TIMEOUT_S)" in (
        capsys.readouterr().err
    )


@pytest.mark.unit
def test_the_launcher_waits_for_a_check_in_as_long_as_the_work_timeout_the_workers_told(monkeypatch, capsys):
    monkeypatch.setenv("LOOM_HEAL_CHECKIN_TIMEOUT_S", "0.05")
    job = Launcher()
    for r in range(3):
        job.store.set(f"guard/{r}/0", '{"work_s": 0.4}')
    _started(job)
    job.store.set("q/1/in/0", "1")
    job.store.set("q/1/in/1", "1")
    job.quorum.tick()
    threading.Event().wait(0.1)
    job.quorum.tick()
    assert job.running[2] and not job.store.check(
        ["q/2/members"]
    )  # past heal's 0.05 s, within the 0.4 s told
    threading.Event().wait(0.4)
    job.quorum.tick()
    assert job.running[2] is False and job.members(2) == "0:0,1:0"
    assert "worker rank 2 did not check in within 0.4 s (work_timeout_s / LOOM_WORK_TIMEOUT_S)" in (
        capsys.readouterr().err
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_frozen_member_is_dropped_at_the_liveness_timeout_and_replaced(tmp_path):
    # heal's own heartbeat timeout is 10 s; the liveness timeout set (2 s) is the one applied
    result, out, run_dir = run_heal(tmp_path, "freeze@1:3:during", LOOM_LIVENESS_TIMEOUT_S="2")
    check_healed_job(result, out, run_dir, 10, {1: 1})
    assert (
        "worker rank 1 sent no heartbeat for 2 s (liveness_timeout_s / LOOM_LIVENESS_TIMEOUT_S): dropped and killed"
        in result.stderr
    ), result.stderr[-3000:]
