"""The guard's timeouts under heal (issue 39, item 2): a member lost under heal is replaced, not waited for, so
``hang_timeout_s`` bounds each collective of an epoch's group, ``work_timeout_s`` the launcher's wait for a
member's check-in and ``liveness_timeout_s`` its heartbeat (`loom.fault.quorum.Quorum.apply_guard`, read by
`loom.launch.heal.HealQuorum`); each one unset keeps heal's own setting. Before, they were refused under heal."""

from __future__ import annotations

import json
import re
import threading
import time
from types import SimpleNamespace

import pytest
from test_heal import check_healed_job, run_heal
from test_heal_units import Launcher, MemoryStore

from loom.fault import watchdog as watchdog_module
from loom.fault.quorum import HEARTBEAT_S, Quorum, read_guard, read_place
from loom.fault.watchdog import Watchdog
from loom.train.guard import GuardOptions, set_timeouts


def _quorum(store: MemoryStore) -> Quorum:
    return Quorum(store, rank=1, generation=2)


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
@pytest.mark.timeout(30)
def test_under_heal_the_watchdog_thread_sends_the_quorums_heartbeat_and_judges_nothing(monkeypatch):
    """One heartbeat thread per process (issue 39, item 2): under heal the guard's watchdog thread beats
    ``hb/RANK/GEN`` and publishes the member's place in ``at/RANK`` for the launcher, and stops nothing itself: a
    collective past the hang timeout is the epoch group's to end, a lost member the launcher's to replace."""
    monkeypatch.setattr(watchdog_module, "_active", None)
    store = MemoryStore()
    quorum = Quorum(store, rank=1, generation=2)
    topology = SimpleNamespace(rank=1, world_size=3, is_distributed=True)
    watchdog = Watchdog.start(topology, timeout_s=0.1, work_timeout=0.1, liveness_timeout=0.5, quorum=quorum)
    assert watchdog.poll_s == HEARTBEAT_S
    quorum.count_with(watchdog)
    try:
        with watchdog.collective("gradient all-reduce"):
            # far past the hang and work timeouts (0.1 s): judged, it would end this process; waited for beats,
            # not for a time (a loaded host may delay the thread)
            deadline = time.monotonic() + 20
            while int(store.get("hb/1/2")) < 3 and time.monotonic() < deadline:
                time.sleep(HEARTBEAT_S)
            beats = int(store.get("hb/1/2"))
            assert beats >= 3, beats
            assert read_place(store.get("at/1"), 0, 2)["current"] == ["gradient all-reduce", 1]
        assert not [
            k for k in store.data if k.startswith("loom/watchdog/")
        ]  # no ring heartbeat, no hang record
    finally:
        watchdog.stop()
    stopped = store.get("hb/1/2")
    time.sleep(2 * HEARTBEAT_S)
    assert store.get("hb/1/2") == stopped  # the thread ended with the watchdog
    assert not store.check(["bye/1/2"])  # the quorum says goodbye when it closes, not the watchdog
    quorum.close()
    assert store.check(["bye/1/2"])


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_under_heal_a_failed_beat_is_tried_again_at_the_next_poll():
    """A store call that fails once does not silence the heartbeat for the watchdog's backoff (seconds): the
    launcher's liveness timeout under heal may be a few beats (``LOOM_HEAL_HEARTBEAT_TIMEOUT_S=2``)."""

    class FailingOnce(MemoryStore):
        failed = False

        def add(self, key: str, value: int) -> int:
            if key.startswith("hb/") and not self.failed:
                self.failed = True
                raise ConnectionResetError("the store's connection was reset")
            return super().add(key, value)

    store = FailingOnce()
    quorum = Quorum(store, rank=1, generation=0)
    watchdog = Watchdog(1, 3, None, store, liveness_timeout=20.0)  # no thread: the test polls
    watchdog.quorum = quorum
    watchdog._beat_for_quorum()
    assert store.failed and not store.check(["hb/1/0"])
    watchdog._beat_for_quorum()  # the next poll
    assert int(store.get("hb/1/0")) == 1
    quorum.close()


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


# -- who did not arrive, under heal (issue 39) -------------------------------------------------------------------


def _counted_quorum(store: MemoryStore, timeout_s: float) -> tuple[Quorum, Watchdog]:
    """Rank 0's quorum in epoch 3 (members 0, 1 and rank 2's first replacement), its collectives counted by a
    watchdog without a thread (the test calls `place` as the heartbeat does) that had counted 4 before the epoch."""
    quorum = Quorum(store, rank=0, generation=0)
    quorum.apply_guard(timeout_s, None, None)
    watchdog = Watchdog(0, 3, 30.0)
    quorum.count_with(watchdog)
    for _ in range(4):
        with watchdog.collective("gradient all-reduce"):
            pass
    quorum._formed(3, [(0, 0), (1, 0), (2, 1)])
    return quorum, watchdog


def _place(epoch: int, gen: int, current: list | None, done: list | None) -> str:
    return json.dumps({"gen": gen, "epoch": epoch, "time": time.time(), "current": current, "done": done,
                       "waiting_s": 1.0 if current else None})  # fmt: skip


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_collective_that_timed_out_names_the_member_that_did_not_arrive(capsys):
    store = MemoryStore()
    quorum, watchdog = _counted_quorum(store, 0.2)
    with watchdog.collective("loss all-reduce"):
        pass
    # rank 1 completed the epoch's first collective and is outside; rank 2 waits in the second with rank 0
    store.set("at/1", _place(3, 0, None, ["loss all-reduce", 1]))
    store.set("at/2", _place(3, 1, ["gradient all-reduce", 2], ["loss all-reduce", 1]))
    watchdog.enter("gradient all-reduce")
    assert quorum.place()["current"] == ["gradient all-reduce", 2]  # numbered within the epoch
    time.sleep(0.25)  # past the group's timeout, seen inside by the heartbeat
    assert quorum.place()["waiting_s"] >= 0.2
    watchdog.leave()  # the collective raised
    quorum._name_the_absent(step=7)
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith(
        "loom: rank 0: step 7 dropped: collective #2 of epoch 3 ('gradient all-reduce') timed out after 0.2 s "
        "(hang_timeout_s / LOOM_HANG_TIMEOUT_S); member(s) rank 1 did not arrive. HINT: "
    ), err
    assert "LOOM_HANG_TIMEOUT_S if its work there is just slow" in first
    assert "  rank 1: last completed 'loss all-reduce' #1; not in a collective" in err
    assert "  rank 2: last completed 'loss all-reduce' #1; in 'gradient all-reduce' #2" in err

    # a record of an earlier epoch, or of the rank's previous process, has not arrived at any of this epoch's
    store.set("at/1", _place(3, 0, ["gradient all-reduce", 2], None))
    store.set("at/2", _place(3, 0, ["gradient all-reduce", 2], None))  # generation 0: rank 2's lost process
    watchdog.enter("gradient all-reduce")
    quorum.place()
    time.sleep(0.25)
    quorum.place()
    watchdog.leave()
    quorum._name_the_absent(step=8)
    assert (
        "step 8 dropped: collective #3 of epoch 3 ('gradient all-reduce') timed out after 0.2 s"
        in (err := capsys.readouterr().err)
        and "member(s) rank 1, 2 did not arrive" in err
    ), err


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_collective_that_failed_sooner_than_its_timeout_names_nobody(capsys):
    store = MemoryStore()
    quorum, watchdog = _counted_quorum(store, 5.0)
    store.set("at/1", _place(3, 0, None, None))
    watchdog.enter("gradient all-reduce")
    quorum.place()  # seen inside, then it failed at once (a lost member's connection closed)
    watchdog.leave()
    quorum._name_the_absent(step=5)
    quorum._name_the_absent(step=5)  # re-forming for a replacement, nothing failed
    assert capsys.readouterr().err == ""


@pytest.mark.unit
@pytest.mark.parametrize(
    "raw",
    [b"{", b"[1]", b'{"epoch": 3, "gen": 0}', b'{"time": "now"}', b'{"time": 1' + b" " * 1100 + b"}"],
)  # fmt: skip
def test_what_a_member_reads_of_anothers_place_is_bounded_and_checked(raw):
    assert read_place(raw, 3, 0) is None


@pytest.mark.unit
def test_a_place_whose_fields_are_malformed_reads_as_no_collective():
    raw = json.dumps({"gen": 0, "epoch": 3, "time": 1.0, "current": ["x" * 500, "2"], "done": ["op", 2.5],
                      "waiting_s": "long"}).encode()  # fmt: skip
    assert read_place(raw, 3, 0) == {"current": None, "done": None, "time": 1.0, "waiting_s": None}
    raw = json.dumps({"gen": 0, "epoch": 3, "time": 1.0, "current": ["x" * 500, 2]}).encode()
    assert read_place(raw, 3, 0)["current"] == ["x" * 80, 2]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_launchers_line_says_where_among_the_collectives_a_member_that_did_not_check_in_was(
    monkeypatch, capsys
):
    monkeypatch.setenv("LOOM_HEAL_CHECKIN_TIMEOUT_S", "0.05")
    job = Launcher()
    _started(job)
    job.store.set("at/1", _place(1, 0, ["gradient all-reduce", 5], ["gradient all-reduce", 4]))
    job.store.set("at/2", _place(1, 0, None, ["gradient all-reduce", 4]))
    job.store.set("q/1/in/0", "4")
    job.quorum.tick()
    threading.Event().wait(0.1)
    job.quorum.tick()
    err = capsys.readouterr().err
    assert (
        "worker rank 1 did not check in within 0.05 s (LOOM_HEAL_CHECKIN_TIMEOUT_S), inside collective #5 "
        "('gradient all-reduce') of epoch 1: dropped and killed" in err
    ), err
    assert (
        "worker rank 2 did not check in within 0.05 s (LOOM_HEAL_CHECKIN_TIMEOUT_S), outside the collectives of "
        "epoch 1 after #4 ('gradient all-reduce'): dropped and killed" in err
    ), err


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_member_late_for_the_exchange_is_named_by_the_others_at_the_hang_timeout(tmp_path):
    # rank 1 pauses 7 s right before step 3's exchange (it keeps its heartbeat); the others wait in it for the hang
    # timeout (3 s), drop the step naming rank 1, and re-form with it when it checks in: nobody is replaced
    result, out, run_dir = run_heal(
        tmp_path, "slow@1:3:during", steps=6, LOOM_HANG_TIMEOUT_S="3", LOOM_FAULTS_SLOW_S="7"
    )
    check_healed_job(result, out, run_dir, 6, {})
    named = [line for line in result.stderr.splitlines() if "step 3 dropped: collective #" in line]
    assert {line.partition(": step")[0].rpartition("rank ")[2] for line in named} == {"0", "2"}, (
        result.stderr[-4000:]
    )
    pattern = (
        r"step 3 dropped: collective #\d+ of epoch 1 \('gradient all-reduce'\) timed out after 3 s "
        r"\(hang_timeout_s / LOOM_HANG_TIMEOUT_S\); member\(s\) rank 1 did not arrive\."
    )
    assert all(re.search(pattern, line) for line in named), named
    # each member's own line names the collective's error (gloo's timeout, or its peer closing), not the
    # ValueError torch's logging wrapper raises over it for a group outside torch's registry
    dropped = [line for line in result.stderr.splitlines() if "step 3 dropped in epoch 1" in line]
    assert dropped and all("(RuntimeError: " in line for line in dropped), dropped
