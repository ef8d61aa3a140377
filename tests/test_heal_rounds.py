"""``loom run --on-worker-failure heal`` for LocalSGD and DiLoCo (issue 23): the unit of commit is the sync round.

A worker killed or frozen during an inner step or during the round's synchronization, an error raised there, two
failures in a row, and the death of the peer a replacement heals from: every member drops the whole round, restores
its round-start state and redoes the round's global batches divided among the members present. Checked: the final
parameters equal a one-process simulation of the strategy with the same membership per round (plain SGD inner steps,
so the simulation is exact; 1e-5), the survivors keep their process, the replacement is bitwise equal to the others
at the round boundary it joins, the members are bitwise equal at every round's end, and the step records hold every
step once with the share of the round's members."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import torch
from test_heal import model_and_data, reports, run_heal
from torch import nn

from loom.data.sampler import share_bounds

GLOBAL_BATCH, H, STEPS = 12, 3, 12


def late_joins(faults: str) -> str:
    """``faults`` with each killed or frozen process's replacement made to join late (``slow@R:1:join#G+1``):
    a replacement from a warm spare is ready within ~0.2 s, often before the survivors re-form, and would then
    redo the dropped round with them, so no round would be trained by fewer members; these tests are about those
    rounds (test_heal.py covers the prompt join)."""
    late = []
    for item in filter(None, faults.split(",")):
        kind, _, rest = item.partition("@")
        if kind in ("kill", "freeze"):
            rank, gen = rest.split(":")[0], int(rest.partition("#")[2] or 0)
            late.append(f"slow@{rank}:1:join#{gen + 1}")
    return ",".join([faults, *late])


def run_rounds(tmp_path: Path, strategy: str, faults: str, momentum: float = 0.0, timeout: float = 120.0,
               **env_extra: str) -> tuple[subprocess.CompletedProcess, Path, Path]:  # fmt: skip
    """test_heal.py's run of heal_train.py with ``strategy`` (localsgd or diloco), each replacement joining late."""
    env_extra.setdefault("LOOM_FAULTS_SLOW_S", "1.5")
    return run_heal(tmp_path, late_joins(faults), steps=STEPS, timeout=timeout, HEAL_H=str(H),
                    HEAL_STRATEGY=strategy, HEAL_MOMENTUM=str(momentum), **env_extra)  # fmt: skip


def global_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The job's global batches, in order (one process's loader: the order depends only on the seed)."""
    from loom.data.loader import loader
    from loom.topology import Topology

    _model, _opt, data = model_and_data()
    batches = loader(data, GLOBAL_BATCH, seed=0, topology=Topology(0, 1, 0, 1, "none"))
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    while len(found) < steps:
        found.extend((x, y) for x, y in batches)
    return found[:steps]


def simulate(strategy: str, members_per_round: list[list[int]], momentum: float = 0.0,
             replaced: dict[int, list[int]] | None = None) -> list[torch.Tensor]:  # fmt: skip
    """One process: each round r trained by m_r replicas from the same start, replica i on share i of each of
    the round's global batches (SGD, lr 0.1, ``momentum``, on its share's mean loss), then LocalSGD's average
    weighted by samples, or DiLoCo's outer Nesterov SGD (lr 0.7, momentum 0.9) on the weighted mean
    pseudo-gradient. Each rank keeps its own inner optimizer state across rounds; ``replaced``: round -> the
    ranks whose replacement joined at its start, which take the state of the round's first other member."""
    from loom.parallel.replica.diloco import default_outer_optimizer

    model, _opt, _data = model_and_data()
    batches = global_batches(len(members_per_round) * H)
    global_copy = [p.detach().clone() for p in model.parameters()]
    outer = default_outer_optimizer(global_copy)
    replicas = {r: copy.deepcopy(model) for r in range(3)}
    inner = {r: torch.optim.SGD(replicas[r].parameters(), lr=0.1, momentum=momentum) for r in range(3)}
    for r, members in enumerate(members_per_round):
        new = (replaced or {}).get(r, [])
        source = next(rank for rank in members if rank not in new)  # the first member holding the state
        for rank in new:
            inner[rank].load_state_dict(copy.deepcopy(inner[source].state_dict()))
        m, trained, counts = len(members), [], []
        for i, rank in enumerate(members):
            replica = replicas[rank]
            with torch.no_grad():
                for p, start in zip(replica.parameters(), model.parameters(), strict=True):
                    p.copy_(start)
            n = 0
            for x, y in batches[r * H : (r + 1) * H]:
                lo, hi = share_bounds(len(x), i, m)
                if hi > lo:
                    inner[rank].zero_grad()
                    nn.MSELoss()(replica(x[lo:hi]), y[lo:hi]).backward()
                    inner[rank].step()
                n += hi - lo
            trained.append([p.detach().clone() for p in replica.parameters()])
            counts.append(n)
        total = sum(counts)
        with torch.no_grad():
            if strategy == "localsgd":
                for j, p in enumerate(model.parameters()):
                    p.copy_(sum(trained[i][j] * (counts[i] / total) for i in range(m)))
            else:
                for j, g in enumerate(global_copy):
                    g.grad = sum((g - trained[i][j]) * (counts[i] / total) for i in range(m))
                outer.step()
                for p, g in zip(model.parameters(), global_copy, strict=True):
                    p.copy_(g)
    return [p.detach().reshape(-1) for p in model.parameters()]


def check_healed_rounds(result, out: Path, run_dir: Path, strategy: str, lost: dict[int, int],
                        momentum: float = 0.0, atol: float = 1e-5) -> list[list[int]]:  # fmt: skip
    """The checks every healed run passes; ``lost``: rank -> processes it lost. Returns the members per round."""
    assert result.returncode == 0, result.stderr[-3000:]
    found = reports(out)
    assert set(found) == {(r, g) for r in range(3) for g in range(lost.get(r, 0) + 1)}, sorted(found)
    last = {r: found[(r, lost.get(r, 0))] for r in range(3)}
    ends = range(H, STEPS + 1, H)
    at_end: dict[int, set[str]] = {s: set() for s in ends}
    members: dict[int, set[tuple[int, ...]]] = {s: set() for s in ends}
    for d in found.values():
        for step, _t, trained_by, digest, *_ in d["steps"]:
            if step % H == 0:
                at_end[step].add(digest)
                members[step].add(tuple(trained_by))
    assert all(len(h) == 1 for h in at_end.values()), f"members differ at a round's end: {at_end}"
    assert all(len(m) == 1 for m in members.values()), f"members disagree on a round's membership: {members}"
    rounds = [list(next(iter(members[s]))) for s in ends]
    for r in range(3):  # survivors kept their process: one process trained every step
        if r not in lost:
            assert [s[0] for s in last[r]["steps"]] == list(range(1, STEPS + 1))
            assert last[r]["pid"] == found[(r, 0)]["pid"]
    for r in lost:  # the replacement joined at a round boundary, bitwise equal to the others there
        new = last[r]
        joined = new["joined_at_step"]
        assert joined > 0 and joined % H == 0 and new["steps"], f"rank {r}'s replacement: {new}"
        assert at_end[joined] == {new["first_hash"]}
        assert r in rounds[joined // H]
    replaced: dict[int, list[int]] = {}
    for (r, g), d in found.items():
        if g:
            replaced.setdefault(d["joined_at_step"] // H, []).append(r)
    want = simulate(strategy, rounds, momentum, replaced)
    for r in range(3):
        got = [torch.tensor(v) for v in last[r]["final"]]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=atol)
    # the step records: every committed step once, with this member's share of its round's members
    sizes = [len(x) for x, _ in global_batches(STEPS)]
    for r in range(3):
        for g in range(lost.get(r, 0) + 1):
            name = f"rank{r}{f'.heal{g}' if g else ''}.jsonl"
            records = [json.loads(line) for line in (run_dir / "metrics" / name).read_text().splitlines()]
            steps = [x["step"] for x in records]
            first = found[(r, g)]["joined_at_step"] + 1
            assert steps == list(range(first, first + len(steps))), (name, steps)
            for x in records:
                m = rounds[(x["step"] - 1) // H]
                lo, hi = share_bounds(sizes[x["step"] - 1], m.index(r), len(m))
                assert (x["global_samples"], x["samples"]) == (sizes[x["step"] - 1], hi - lo), (name, x)
    _print_timings(found, run_dir)
    return rounds


def _print_timings(found: dict, run_dir: Path) -> None:
    """Kill -> the survivors' next committed round end (run with ``-s``; no test asserts on timing)."""
    noted = run_dir / "faults.jsonl"
    for kill in [json.loads(line) for line in noted.read_text().splitlines()] if noted.exists() else []:
        after = [t for d in found.values() if d["rank"] != kill["rank"] for s, t, *_ in d["steps"]
                 if t > kill["time"] and s % H == 0]  # fmt: skip
        if after:
            print(f"\nheal rounds timing: kill of rank {kill['rank']} at step {kill['step']} ({kill['phase']}) -> "
                  f"survivors' next committed round: {min(after) - kill['time']:.3f} s")  # fmt: skip


KILLS = {
    "an inner step": ("kill@1:2:before", {1: 1}),
    "the round's averaging": ("kill@1:3:during", {1: 1}),
    "the vote of a round": ("kill@2:6:after", {2: 1}),
    "after the vote of a round": ("kill@1:3:commit", {1: 1}),
    "two failures in a row": ("kill@1:3:during,kill@2:4:before", {1: 1, 2: 1}),
    "the healing peer's send": ("kill@1:3:during,kill@0:1:send", {0: 1, 1: 1}),
    "a member lost as the next epoch forms": ("kill@1:3:during,kill@2:2:form", {1: 1, 2: 1}),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(KILLS))
def test_local_sgd_kill_drops_the_round_and_the_job_equals_the_simulation(tmp_path, case):
    faults, lost = KILLS[case]
    result, out, run_dir = run_rounds(tmp_path, "localsgd", faults)
    rounds = check_healed_rounds(result, out, run_dir, "localsgd", lost)
    assert len(rounds[0]) < 3 or len(rounds[1]) < 3, f"no round was trained by fewer members: {rounds}"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "faults", ["raise@2:3:during", "raise@1:4:after", "raise@0:5:before", "raise@1:3:commit"]
)
def test_local_sgd_error_drops_the_round_on_every_member_and_it_is_redone(tmp_path, faults):
    # raise@1:4:after: rank 1 fails after step 4's all-reduce, the others meet it at step 5's: they redo the
    # round from different steps and must still meet in the same collectives; raise@1:3:commit: the round was
    # committed, and the call that raised returns without training its batch again
    result, out, run_dir = run_rounds(tmp_path, "localsgd", faults)
    rounds = check_healed_rounds(result, out, run_dir, "localsgd", {})
    assert rounds == [[0, 1, 2]] * (STEPS // H)
    step = int(faults.split(":")[1])
    if faults.endswith("commit"):  # after a round's vote: the member that raised says so, the next step drops
        assert f"step {step} failed after its commit in epoch 1 (InjectedFault" in result.stderr
        assert f"step {step + 1} dropped" in result.stderr
    else:
        assert (
            "dropped in epoch 1 (InjectedFault" in result.stderr and f"step {step} dropped" in result.stderr
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("faults,lost", [("kill@1:2:before", {1: 1}), ("kill@2:6:during", {2: 1}),
                                         ("raise@0:3:during", {})])  # fmt: skip
def test_diloco_failure_drops_the_round_and_the_job_equals_the_simulation(tmp_path, faults, lost):
    result, out, run_dir = run_rounds(tmp_path, "diloco", faults)
    check_healed_rounds(result, out, run_dir, "diloco", lost)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_local_sgd_with_momentum_replacement_takes_a_live_peers_optimizer_state(tmp_path):
    # each rank keeps its own momentum across rounds; the lost replica's is gone and its replacement takes the
    # first member's: the simulation that does exactly this is matched (1e-5)
    result, out, run_dir = run_rounds(tmp_path, "localsgd", "kill@1:2:before", momentum=0.9)
    check_healed_rounds(result, out, run_dir, "localsgd", {1: 1}, momentum=0.9)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_diloco_frozen_member_is_dropped_when_its_heartbeat_stops_and_its_round_redone(tmp_path):
    result, out, run_dir = run_rounds(
        tmp_path, "diloco", "freeze@1:5:before", LOOM_HEAL_HEARTBEAT_TIMEOUT_S="2"
    )
    check_healed_rounds(result, out, run_dir, "diloco", {1: 1})
    assert "worker rank 1 sent no heartbeat for 2 s (LOOM_HEAL_HEARTBEAT_TIMEOUT_S): dropped and killed" in (
        result.stderr
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("strategy", "options", "atol"),
    [
        ("localsgd", {"allreduce": "ring"}, 1e-5),
        ("diloco", {"allreduce": "driver"}, 1e-5),
        ("diloco", {"compression": "bf16"}, 1e-2),  # each member's share rounded to bf16 (measured: 6e-4)
        ("diloco", {"compression": "int8"}, 1e-2),  # int8 codes, a scale per chunk (measured: 2e-3)
    ],
    ids=["localsgd-ring", "diloco-driver", "diloco-bf16", "diloco-int8"],
)
def test_round_options_under_heal_equal_the_simulation(tmp_path, strategy, options, atol):
    # the round's synchronization is the strategy's own, over each membership epoch's group: its options run
    # under heal as without it; a kill inside it drops the round and the job equals the simulation
    result, out, run_dir = run_rounds(
        tmp_path, strategy, "kill@1:3:during", HEAL_ROUND_OPTIONS=json.dumps(options)
    )
    check_healed_rounds(result, out, run_dir, strategy, {1: 1}, atol=atol)
