"""The pieces of healing without processes (issue 23): the (rank, step, phase) fault plan, the refusal of
``heal`` by strategies that cannot heal, the launcher's quorum decisions (`loom.launch.heal.HealQuorum`) and the
commit vote (`loom.fault.quorum.Quorum.vote`), each on an in-memory store."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from torch import nn

import loom
from loom.fault.inject import parse_faults
from loom.fault.quorum import Quorum
from loom.launch.heal import HealPolicy, HealQuorum, JobStops
from loom.topology import Topology

pytestmark = pytest.mark.unit

LAUNCHED = Topology(0, 1, 0, 1, "gloo")  # a launched job's: the refusal comes before any collective


class MemoryStore:
    """The store calls the quorum makes, in memory (atomic under one lock, as the store server's are)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def clone(self) -> MemoryStore:
        return self

    def set(self, key: str, value: str | bytes) -> None:
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def add(self, key: str, value: int) -> int:
        with self.lock:
            n = int(self.data.get(key, b"0")) + value
            self.data[key] = str(n).encode()
            return n

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self.lock:
            current = self.data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self.data[key] = desired.encode()
                return desired.encode()
            return current if current is not None else expected.encode()


def test_fault_plans_parse_and_refuse_malformed_items():
    faults = parse_faults("kill@1:3:during, raise@0:2:before#1")
    assert [(f.kind, f.rank, f.step, f.phase, f.generation) for f in faults] == [
        ("kill", 1, 3, "during", 0),
        ("raise", 0, 2, "before", 1),
    ]
    for bad in ("kill@1:3", "kill@1:3:inside", "boom@1:3:before"):
        with pytest.raises(ValueError, match="KIND@RANK:STEP:PHASE"):
            parse_faults(bad)


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: loom.Gossip(topology=LAUNCHED), "membership that changes between steps"),
        (
            lambda: loom.ParameterServer(mode="async", topology=LAUNCHED),
            "membership that changes between steps",
        ),
        (
            lambda: loom.ShardedDataParallel(topology=LAUNCHED),
            "only copy of its shard of the optimizer state",
        ),
        (lambda: loom.Pipeline(stages=1, topology=LAUNCHED), "only copy of its stage or shard of the model"),
    ],
)
def test_strategies_that_cannot_heal_refuse_it_naming_the_ones_that_can(make, why, monkeypatch):
    """On a launched job's topology (an explicit backend="none" one is a plain job: test_failure_policy)."""
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", "heal")
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=rf"--on-worker-failure heal: .* cannot heal .*{why}.*HINT: use a strategy "
                       r"that heals: DataParallel, LocalSGD, DiLoCo"):  # fmt: skip
        make().setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss)


class Launcher:
    """A `HealQuorum` over a `MemoryStore`, with processes that are flags."""

    def __init__(self, nproc: int = 3, **policy: int) -> None:
        self.store = MemoryStore()
        self.running = dict.fromkeys(range(nproc), True)
        self.started: list[tuple[int, int]] = []
        self.quorum = HealQuorum(nproc, HealPolicy(**policy), self.store, self.restart,
                                 lambda r: self.running[r], self.kill)  # fmt: skip

    def restart(self, rank: int, generation: int) -> None:
        self.started.append((rank, generation))
        self.running[rank] = True

    def kill(self, rank: int) -> None:
        self.running[rank] = False

    def ready(self, rank: int, generation: int = 0) -> None:
        self.store.set(f"ready/{rank}", str(generation))

    def members(self, epoch: int) -> str:
        return self.store.get(f"q/{epoch}/members").decode()


def test_the_launcher_forms_epochs_replaces_the_dead_and_adds_the_ready(monkeypatch):
    monkeypatch.setenv("LOOM_HEAL_CHECKIN_TIMEOUT_S", "0.05")
    job = Launcher()
    for r in range(3):
        job.quorum.tick()
        job.ready(r)
    job.quorum.tick()
    assert job.members(1) == "0:0,1:0,2:0"
    job.running[1] = False  # rank 1 dies: its epoch is marked, a replacement starts
    job.quorum.died(1, "worker rank 1 was killed by SIGKILL")
    assert job.store.get("q/1/dead") == b"1" and job.started == [(1, 1)]
    job.store.set("q/1/in/0", "2")
    job.quorum.tick()
    assert not job.store.check(["q/2/members"])  # rank 2 has not checked in yet, and is alive
    job.store.set("q/1/in/2", "2")
    job.quorum.tick()
    assert job.members(2) == "0:0,2:0"
    assert job.store.check(["q/2/joining"])  # the replacement is still starting: the members may wait for it
    job.ready(1, generation=1)  # the replacement is ready: the members are told, and re-form after their step
    job.quorum.tick()
    assert job.store.check(["q/2/pending"])
    job.store.set("q/2/in/0", "5")
    job.quorum.tick()
    job.store.set("q/2/in/2", "5")
    job.quorum.tick()
    assert job.members(3) == "0:0,1:1,2:0"


def test_an_epoch_of_replacements_only_is_announced_as_the_loss_of_the_trained_state(monkeypatch, capsys):
    job = Launcher(nproc=2)
    for r in range(2):
        job.ready(r)
    job.quorum.tick()
    job.store.set("q/1/in/0", "1")
    job.quorum.tick()  # rank 1 has not checked in yet: no epoch 2
    job.store.set("q/1/in/1", "1")
    job.quorum.tick()  # epoch 2 of the same processes: nothing announced
    assert job.members(2) == "0:0,1:0" and "WARNING" not in capsys.readouterr().err
    for r in range(2):  # every member lost at once: the replacements form the next epoch alone
        job.running[r] = False
        job.quorum.died(r, f"worker rank {r} was killed by SIGKILL")
        job.ready(r, generation=1)
    job.quorum.tick()
    assert job.members(3) == "0:1,1:1", job.members(3)
    err = capsys.readouterr().err
    assert "WARNING: none of the members of epoch 3 [0, 1] was a member of epoch 2" in err, err


def test_a_member_that_does_not_check_in_is_killed_and_left_out(monkeypatch):
    monkeypatch.setenv("LOOM_HEAL_CHECKIN_TIMEOUT_S", "0.05")
    job = Launcher()
    for r in range(3):
        job.ready(r)
    job.quorum.tick()
    job.store.set("q/1/in/0", "1")
    job.store.set("q/1/in/1", "1")
    job.quorum.tick()
    threading.Event().wait(0.1)
    job.quorum.tick()
    assert job.running[2] is False and job.members(2) == "0:0,1:0"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "heals, least, said",
    [(-1, 1, "--max-heals must be an int >= 0, got -1"), (3, 0, "--min-workers must be an int >= 1, got 0"),
     ("2", 1, "--max-heals must be an int >= 0, got '2'"), (True, 1, "--max-heals must be an int >= 0, got True"),
     (3, 1.5, "--min-workers must be an int >= 1, got 1.5")],
)  # fmt: skip
def test_a_policy_out_of_range_is_refused_on_construction(heals, least, said):
    """`HealPolicy` is public: built directly (not through `loom run`'s checks) it still refuses what cannot hold,
    a wrong type too (review2 finding 7: "2" raised a TypeError, 1.5 and True were accepted), naming the fix."""
    with pytest.raises(ValueError, match=re.escape(said) + r"\. HINT: HealPolicy\("):
        HealPolicy(max_heals=heals, min_workers=least)


def test_the_budgets_stop_the_job_naming_the_lost_ranks(monkeypatch):
    job = Launcher(max_heals=1)
    for r in range(3):
        job.ready(r)
    job.quorum.tick()
    job.quorum.died(1, "worker rank 1 was killed by SIGKILL")
    with pytest.raises(JobStops, match=r"past --max-heals 1: .*lost: worker rank 1 was killed by SIGKILL; "
                       r"worker rank 2 was killed"):  # fmt: skip
        job.quorum.died(2, "worker rank 2 was killed by SIGKILL")
    small = Launcher(min_workers=3)
    for r in range(3):
        small.ready(r)
    small.quorum.tick()
    small.running[0] = False
    small.quorum.died(0, "worker rank 0 was killed by SIGKILL")
    small.store.set("q/1/in/1", "1")
    small.store.set("q/1/in/2", "1")
    with pytest.raises(JobStops, match="2 worker.* below --min-workers 3"):
        small.quorum.tick()


def vote_of(store: MemoryStore, rank: int, members: list[int], step: int, ok: bool) -> bool:
    quorum = Quorum.__new__(Quorum)  # no heartbeat thread: only the vote is under test
    quorum.store, quorum.rank, quorum.epoch, quorum.members = store, rank, 1, members
    quorum.vote_timeout_s, quorum.committed = 5.0, 0
    return quorum.vote(step, ok)


def test_one_verdict_per_step_commit_only_when_every_member_votes_yes():
    store = MemoryStore()
    results: dict[int, bool] = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, vote_of(store, r, [0, 1, 2], 4, True)))
               for r in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True, 2: True}
    store = MemoryStore()
    results = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, vote_of(store, r, [0, 1, 2], 4, r != 1)))
               for r in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: False, 1: False, 2: False}


def test_a_vote_does_not_wait_for_a_member_the_launcher_saw_die():
    store = MemoryStore()
    store.set("q/1/dead", "2")
    assert vote_of(store, 0, [0, 1, 2], 7, True) is False
    assert vote_of(store, 1, [0, 1, 2], 7, True) is False


def test_data_parallel_options_that_heal_cannot_honour_are_refused_by_name():
    from loom.parallel.data.data_axis import refuse_heal_options

    for honoured in ({}, {"allreduce": "ring"}, {"allreduce": "driver"}, {"compression": "int8"},
                     {"compression": "fp16"}, {"accumulate": 3}, {"overlap": False},
                     {"hang_timeout_s": 60, "work_timeout_s": 90, "liveness_timeout_s": 5}):  # fmt: skip
        refuse_heal_options(loom.DataParallel(**honoured).config)
    with pytest.raises(
        ValueError, match=r"compression='powersgd:2' \(.*error-feedback.*HINT: drop compression= under heal"
    ):
        refuse_heal_options(loom.DataParallel(compression="powersgd:2").config)
    with pytest.raises(
        ValueError, match=r"allreduce='shm' \(the shared-memory algorithms.*HINT: drop allreduce= "
    ):
        refuse_heal_options(loom.DataParallel(allreduce="shm").config)
    with pytest.raises(
        ValueError, match=r"overlap=True .*bucket_cap_mb=5.0 .*HINT: drop overlap=, bucket_cap_mb="
    ):
        refuse_heal_options(loom.DataParallel(overlap=True, bucket_cap_mb=5.0).config)


@pytest.mark.timeout(120)
def test_a_member_that_leaves_an_epoch_frees_the_others_waiting_in_its_group():
    """A member that re-forms while the others wait in a collective of the old epoch's group (it raised before
    joining that collective) must close the group, or they wait the group's whole timeout (30 s by default, more
    than the launcher's 10 s check-in timeout: the launcher then kills them). gloo's ``abort()`` closes nothing;
    `Quorum._abandon_group` lets the group go. Here the timeout is 90 s and the waiting members must fail on a
    closed connection, not on the timeout."""
    import torch.distributed as dist

    from loom.fault.quorum import gloo_group

    store = dist.HashStore()
    groups: dict[int, dist.ProcessGroup] = {}

    def build(rank: int) -> None:
        groups[rank] = gloo_group(dist.PrefixStore("q/1/pg/", store), rank, 3, 90.0)

    builders = [threading.Thread(target=build, args=(r,)) for r in range(3)]
    for t in builders:
        t.start()
    for t in builders:
        t.join()
    errors: dict[int, str] = {}

    def wait_in_collective(rank: int) -> None:
        try:
            groups[rank].allreduce([torch.ones(8)]).wait()
            errors[rank] = "completed"
        except RuntimeError as error:
            errors[rank] = str(error)

    waiting = [threading.Thread(target=wait_in_collective, args=(r,)) for r in (0, 2)]
    for t in waiting:
        t.start()
    leaving = Quorum.__new__(Quorum)  # only its group: no store, no heartbeat thread
    leaving.group = groups.pop(1)
    leaving._abandon_group()
    for t in waiting:
        t.join(timeout=100)
    assert leaving.group is None
    assert set(errors) == {0, 2}, errors
    for rank, error in errors.items():
        assert "Connection" in error and "Timed out" not in error, (rank, error)


def joining_quorum(store: MemoryStore, wait_s: float) -> Quorum:
    quorum = Quorum.__new__(Quorum)  # no heartbeat thread: only the wait is under test
    quorum.store, quorum.epoch, quorum.join_wait_s = store, 2, wait_s
    return quorum


def test_the_members_wait_for_a_starting_replacement_until_it_is_ready_and_no_longer_than_the_bound():
    store = MemoryStore()
    joining_quorum(
        store, 60.0
    ).wait_for_joiner()  # nothing starting: no wait (a 60 s bound would time the test out)
    store.set("q/2/joining", "1")
    threading.Timer(0.1, lambda: store.set("q/2/pending", "1")).start()
    joining_quorum(
        store, 60.0
    ).wait_for_joiner()  # returns once the replacement is ready, long before the bound
    assert store.check(["q/2/pending"])
    late = MemoryStore()
    late.set("q/2/joining", "1")
    started = time.monotonic()
    joining_quorum(late, 0.2).wait_for_joiner()  # never ready: the bound ends the wait
    assert time.monotonic() - started >= 0.2
    joining_quorum(late, 0.0).wait_for_joiner()  # LOOM_HEAL_JOIN_WAIT_S=0: never waits


@pytest.mark.timeout(10)
def test_the_summary_counts_the_steps_of_rank_0s_latest_replacement(tmp_path):
    """Review2 finding 4: the summary read rank0.jsonl only, so once rank 0 was replaced it named the step its
    first process died at (5), not the job's last (10), which its replacement wrote to rank0.heal1.jsonl."""
    from loom.launch.agent import summary_line
    from loom.launch.spec import LaunchSpec

    (tmp_path / "train.py").write_text("")
    spec = LaunchSpec(str(tmp_path / "train.py"), nproc=2, on_worker_failure="heal", run_dir=tmp_path)
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "rank0.jsonl").write_text('{"step": 5}\n')
    assert summary_line(spec, 1.0, 0).endswith(", 5 steps; logs and metrics in " + str(tmp_path))
    (metrics / "rank0.heal1.jsonl").write_text('{"step": 10}\n')
    (metrics / "rank1.heal2.jsonl").write_text('{"step": 3}\n')
    assert ", 1 heal(s), 10 steps;" in summary_line(spec, 1.0, 1)
    (metrics / "rank0.heal12.jsonl").write_text('{"step": 12}\n')
    assert ", 12 steps;" in summary_line(spec, 1.0, 2)
