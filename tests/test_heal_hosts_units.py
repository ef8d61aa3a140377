"""Healing across hosts without processes (issue 23): node 0's authority (`loom.launch.heal_nodes.Authority`)
acting through orders and events on an in-memory store, and the launch options that allow it."""

from __future__ import annotations

import time

import pytest
from test_heal_units import MemoryStore

from loom.errors import LauncherStopped
from loom.launch.heal import HealPolicy, JobStops
from loom.launch.heal_nodes import Authority, _Link
from loom.launch.spec import LaunchSpec

pytestmark = pytest.mark.unit


def two_nodes(monkeypatch, **policy: int) -> tuple[Authority, MemoryStore, MemoryStore]:
    monkeypatch.setenv("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", "0.05")
    monkeypatch.setenv("LOOM_HEAL_GROUP_TIMEOUT_S", "0.05")
    agents, job = MemoryStore(), MemoryStore()
    authority = Authority([1, 2], HealPolicy(**policy), _Link(agents, 1.0), job)
    for rank in range(3):
        job.set(f"ready/{rank}", "0")
    authority.tick()
    assert job.get("q/1/members") == b"0:0,1:0,2:0"
    return authority, agents, job


def event(agents: MemoryStore, node: int, text: str) -> None:
    count = int(agents.data.get(f"{node}/events", b"0")) + 1
    agents.set(f"{node}/event/{count}", text)
    agents.set(f"{node}/events", str(count))


def test_a_death_reported_by_node_1_is_healed_by_an_order_to_node_1(monkeypatch):
    authority, agents, job = two_nodes(monkeypatch)
    agents.set("1/hb", "1")
    event(agents, 1, "2 0 -9 worker rank 2 was killed by SIGKILL")
    authority.tick()
    assert job.get("q/1/dead") == b"2"
    assert (agents.get("1/orders"), agents.get("1/order/1")) == (b"1", b"start 2 1")
    assert not agents.check(["0/orders"])
    event(agents, 1, "2 0 -9 the same process again")  # an old generation's event changes nothing
    authority.tick()
    assert authority.quorum.heals == 1


def test_a_script_error_reported_by_a_node_stops_the_job(monkeypatch):
    authority, agents, _job = two_nodes(monkeypatch)
    event(agents, 1, "1 0 1 worker rank 1 failed (exit code 1): ValueError: boom")
    with pytest.raises(
        JobStops, match=r"rank 1 failed \(exit code 1\): ValueError: boom; the script's own error"
    ):
        authority.tick()
    assert not agents.check(["1/orders"])


def test_a_silent_node_is_lost_its_ranks_dropped_without_a_heal(monkeypatch, capsys):
    authority, agents, job = two_nodes(monkeypatch)
    agents.set("1/hb", "1")
    authority.tick()
    time.sleep(0.1)
    authority.tick()
    assert authority.lost_nodes == {1} and authority.quorum.gone == {1, 2}
    assert job.get("q/1/dead") in (b"1", b"2") and not agents.check(["1/orders"])
    assert "node 1 lost: its agent sent no heartbeat for 0.05 s" in capsys.readouterr().err
    job.set("q/1/in/0", "4")  # the survivor checks in: the next epoch is node 0's alone
    authority.tick()
    assert job.get("q/2/members") == b"0:0"


def test_a_lost_node_below_min_workers_stops_the_job(monkeypatch):
    authority, agents, job = two_nodes(monkeypatch, min_workers=2)
    agents.set("1/hb", "1")
    authority.tick()
    time.sleep(0.1)
    authority.tick()
    job.set("q/1/in/0", "4")
    with pytest.raises(JobStops, match="1 worker.* below --min-workers 2"):
        authority.tick()


def test_heal_is_allowed_across_nodes_and_refuses_group_restarts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    LaunchSpec(
        str(script),
        nproc=2,
        nnodes=2,
        node_rank=1,
        master="127.0.0.1:29500",
        on_worker_failure="heal",
        min_workers=3,
    )  # fmt: skip  (node 0 checks --min-workers against the job's 4 workers)
    with pytest.raises(
        ValueError, match="heal replaces lost workers instead of restarting.*--max-restarts 1"
    ):
        LaunchSpec(str(script), on_worker_failure="heal", max_restarts=1)
    with pytest.raises(ValueError, match="continue runs one node"):
        LaunchSpec(str(script), nnodes=2, master="127.0.0.1:29500", on_worker_failure="continue")


def test_a_frozen_worker_on_node_1_is_killed_by_an_order_to_node_1(monkeypatch):
    authority, agents, job = two_nodes(monkeypatch)
    monkeypatch.setattr(authority.quorum, "heartbeat_timeout_s", 0.2)
    for beat in range(1, 4):  # every worker's heartbeat moves but rank 2's; node 1's agent is alive
        for rank in range(2):
            job.set(f"hb/{rank}/0", str(beat))
        job.set("hb/2/0", "1")
        agents.set("1/hb", str(beat))
        authority.tick()
        time.sleep(0.15)
    assert agents.get("1/order/1") == b"kill 2 0" and not authority.lost_nodes
    event(agents, 1, "2 0 -9 worker rank 2 was killed by SIGKILL")
    authority.tick()
    assert agents.get("1/order/2") == b"start 2 1"


def test_a_worker_on_node_1_that_does_not_check_in_is_asked_where_it_is_stuck_before_the_kill(
    monkeypatch, capsys
):
    # issue 37: across hosts too, the stuck member's stacks are printed (on its node) and its place named (here)
    authority, agents, job = two_nodes(monkeypatch)
    monkeypatch.setattr(authority.quorum, "checkin_timeout_s", 0.05)
    agents.set("1/hb", "1")
    agents.set("1/place/2/0", 'File "train.py", line 12 in stuck')  # node 1's answer to the order below
    job.set("q/1/in/0", "3")
    job.set("q/1/in/1", "3")
    authority.tick()
    time.sleep(0.1)
    agents.set("1/hb", "2")  # node 1's agent is alive
    authority.tick()
    assert [agents.get(f"1/order/{i}") for i in (1, 2)] == [b"dump 2 0", b"kill 2 0"]
    assert (
        'worker rank 2 did not check in within 0.05 s (LOOM_HEAL_CHECKIN_TIMEOUT_S), stuck at File "train.py", '
        in (capsys.readouterr().err)
    )
    assert authority.quorum.stuck == {(2, 'File "train.py", line 12 in stuck'): 1}


def test_node_1s_agent_answers_a_dump_order_with_the_place_of_its_worker(monkeypatch):
    from loom.launch import heal_nodes

    asked: list[int] = []
    monkeypatch.setattr(
        heal_nodes, "stuck_place", lambda pid, tail: asked.append(pid) or "File a.py, line 3 in f"
    )

    class Proc:
        pid = 4242

        def poll(self):
            return None

    class Worker:
        proc, tail = Proc(), None

    agents = MemoryStore()
    agent = heal_nodes.NodeAgent(1, 2, 1, _Link(agents, 1.0), lambda rank, generation: Worker())
    agent._obey("dump 2 0")
    agent._obey("dump 2 7")  # another generation's process: not this one, nothing asked
    assert asked == [4242]
    assert agents.get("1/place/2/0") == b"File a.py, line 3 in f" and agents.get("1/place/2/7") == b""


@pytest.mark.unit
def test_a_stop_signal_during_a_store_call_stops_the_launcher_and_a_failing_store_does_not():
    """`_Link` turns a store that does not answer into None (retried next tick), never the launcher's stop
    signal (SIGTERM/SIGINT raise `LauncherStopped` wherever the loop is, a store call included)."""

    class Store:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def check(self, keys: list[str]) -> bool:
            raise self.error

    assert _Link(Store(ConnectionResetError("reset")), 1.0)("check", ["end"]) is None
    with pytest.raises(LauncherStopped):
        _Link(Store(LauncherStopped(15)), 1.0)("check", ["end"])


class _Agent:
    """What `_follow` asks of node 1's agent (its workers already ended)."""

    node, all = 1, []

    def tick(self) -> None:
        pass

    def running(self) -> list:
        return []

    def dismiss(self) -> None:
        pass


@pytest.mark.timeout(10)
def test_a_follower_names_the_heals_node_0_told_when_it_stopped_the_job_or_ended_it(tmp_path, capsys):
    """Review2 findings 2 and 6: the follower said "0 heal(s)" when node 0 stopped the job (past --max-heals, the
    common failing case); node 0 now sets ``heals`` before ``stop``. The count is read from the store: only an int
    in 0..--max-heals is believed, anything else is unknown (None), not a traceback nor "-5 heal(s)"."""
    from loom.launch.agent import summary_line
    from loom.launch.heal_nodes import _follow

    agents = MemoryStore()
    link = _Link(agents, 1.0)
    agents.set("heals", "1")
    agents.set("stop", "worker rank 1 was killed by SIGKILL; past --max-heals 1: the job stops")
    assert _follow(_Agent(), link, "127.0.0.1", 1, 1) == (1, 1)
    assert "node 0 stopped the job: worker rank 1 was killed" in capsys.readouterr().err
    del agents.data["stop"]
    for told, heals in [("2", 2), ("3", 3), ("4", None), ("-5", None), ("x", None), ("9" * 5000, None)]:
        agents.set("end", told)
        assert _follow(_Agent(), link, "127.0.0.1", 1, 3) == (0, heals), told
    script = tmp_path / "train.py"
    script.write_text("")
    spec = LaunchSpec(str(script), nnodes=2, master="127.0.0.1:1", on_worker_failure="heal", run_dir=tmp_path)
    assert "2 nodes, heals unknown; logs and metrics in" in summary_line(spec, 1.0, None, failed=True)


@pytest.mark.timeout(10)
def test_a_refused_heal_job_is_one_line_without_a_summary_and_an_unknown_count_is_said(
    tmp_path, monkeypatch, capsys
):
    """Review2 finding 3: a job refused at registration (status 2: it never started) printed a "failed after"
    summary after its one-line refusal; a follower that lost node 0 (heals None) says "heals unknown"."""
    from loom.launch import agent, heal_nodes

    script = tmp_path / "train.py"
    script.write_text("")
    spec = LaunchSpec(str(script), nnodes=2, master="127.0.0.1:1", on_worker_failure="heal", run_dir=tmp_path)
    monkeypatch.setattr(heal_nodes, "heal_across_nodes", lambda *args: (2, 0))
    assert agent._supervised(spec, "r", "127.0.0.1", 1) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(heal_nodes, "heal_across_nodes", lambda *args: (1, 2))
    assert agent._supervised(spec, "r", "127.0.0.1", 1) == 1
    assert "loom run: failed after " in capsys.readouterr().err
