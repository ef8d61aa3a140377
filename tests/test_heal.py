"""``loom run --on-worker-failure heal`` (issue 23): a worker killed before, during or after the gradient exchange
(and after the commit vote) is replaced while the others go on in the same processes; the replacement is bitwise
equal to the others at its first step; every committed global batch is trained exactly once, divided among the
members present (the step records add up to the global batch), and the final parameters equal one process on the
same global batches (1e-5). Also: two failures in a row, the healing peer's failure, the --max-heals budget.

Each test prints the time from the kill to the survivors' next committed step and from the replacement's process
start to its first trained step (run with ``-s`` to see them; no test asserts on timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, _kill_group
from torch import nn

from loom.data.sampler import share_bounds

SCRIPT = WORKERS / "heal_train.py"
SRC = Path(__file__).resolve().parent.parent / "src"
GLOBAL_BATCH = 12
SAMPLES = 64  # heal_train.py's dataset: 5 global batches of 12 and one of 4 per epoch


def global_size(step: int) -> int:
    per_epoch = -(-SAMPLES // GLOBAL_BATCH)
    return GLOBAL_BATCH if step % per_epoch else SAMPLES - (per_epoch - 1) * GLOBAL_BATCH


def run_heal(tmp_path: Path, faults: str, *args: str, steps: int = 10, pause_s: float = 0.0,
             timeout: float = 180.0, heal: bool = True,
             **env_extra: str) -> tuple[subprocess.CompletedProcess, Path, Path]:  # fmt: skip
    """heal_train.py under ``loom run -n 3 --on-worker-failure heal`` (``heal=False``: without it)."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", HEAL_OUT=str(out),
               HEAL_STEPS=str(steps), HEAL_PAUSE_S=str(pause_s), LOOM_FAULTS=faults, **env_extra)  # fmt: skip
    policy = ["--on-worker-failure", "heal"] if heal else []
    cmd = [sys.executable, "-m", "loom.cli", "run", "-n", "3", *policy, "--run-dir",
           str(run_dir), *args, str(SCRIPT)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        _kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), out, run_dir


def model_and_data(
    momentum: float = 0.9,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.utils.data.Dataset]:
    """heal_train.py's model, SGD with this ``momentum``, and data."""
    sys.path.insert(0, str(WORKERS))
    try:
        import heal_train  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(WORKERS))
    return heal_train.model_and_data(momentum)


def reference(steps: int) -> list[torch.Tensor]:
    """One process on the same global batches: the parameters after ``steps`` steps."""
    from loom.data.loader import loader
    from loom.topology import Topology

    model, optimizer, data = model_and_data()
    batches = loader(data, GLOBAL_BATCH, seed=0, topology=Topology(0, 1, 0, 1, "none"))
    done = 0
    while done < steps:
        for x, y in batches:
            optimizer.zero_grad()
            nn.MSELoss()(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    return [p.detach().reshape(-1) for p in model.parameters()]


def reports(out: Path) -> dict[tuple[int, int], dict]:
    return {(d["rank"], d["generation"]): d for d in (json.loads(f.read_text()) for f in out.glob("*.json"))}


def check_healed_job(
    result, out: Path, run_dir: Path, steps: int, lost: dict[int, int], atol: float = 1e-5
) -> dict:
    """The checks every healed job passes; ``lost``: rank -> processes it lost (its replacements' count);
    ``atol``: how far from one process on the same global batches the final parameters may be."""
    assert result.returncode == 0, result.stderr[-3000:]
    found = reports(out)
    assert set(found) == {(r, g) for r in range(3) for g in range(lost.get(r, 0) + 1)}, sorted(found)
    last = {r: found[(r, lost.get(r, 0))] for r in range(3)}
    hashes: dict[int, set[str]] = {}
    for d in found.values():
        for step, _t, _members, digest, _loss, _size in d["steps"]:
            hashes.setdefault(step, set()).add(digest)
    assert all(len(h) == 1 for h in hashes.values()), "members differ after a committed step"
    assert sorted(hashes) == list(range(1, steps + 1)), "a step was lost"
    for r in range(3):  # survivors kept their process: one process trained every step
        if r not in lost:
            assert [s[0] for s in last[r]["steps"]] == list(range(1, steps + 1))
            assert last[r]["pid"] == found[(r, 0)]["pid"]
    for r in lost:  # the replacement trained like the others from its first step (bitwise)
        new = last[r]
        assert new["joined_at_step"] > 0 and new["steps"], f"rank {r}'s replacement never trained"
        first = new["steps"][0]
        assert first[0] == new["joined_at_step"] + 1
        assert hashes[first[0]] == {first[3]}
    want = reference(steps)
    for r in range(3):
        got = [torch.tensor(v) for v in last[r]["final"]]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=atol)
    # the step records of a rank that lost no process: every step once, its share of the members present
    for r in set(range(3)) - set(lost):
        members = {step: m for step, _t, m, *_ in last[r]["steps"]}
        lines = (run_dir / "metrics" / f"rank{r}.jsonl").read_text().splitlines()
        records = {
            x["step"]: x for x in map(json.loads, lines)
        }  # a step's last line counts (StepMetrics.annotate)
        assert sorted(records) == list(range(1, steps + 1))
        for x in records.values():
            total, m = global_size(x["step"]), members[x["step"]]
            lo, hi = share_bounds(total, m.index(r), len(m))
            assert (x["global_samples"], x["samples"]) == (total, hi - lo), x
    _print_timings(found, run_dir, lost)
    return found


def _print_timings(found: dict, run_dir: Path, lost: dict[int, int]) -> None:
    noted = run_dir / "faults.jsonl"
    kills = [json.loads(line) for line in noted.read_text().splitlines()] if noted.exists() else []
    for kill in kills:  # the survivors' first commit that needed the new membership (a send counts sends)
        first = {"send": 0, "commit": kill["step"] + 1}.get(kill["phase"], kill["step"])
        after = [
            t
            for d in found.values()
            if d["rank"] != kill["rank"]
            for s, t, *_ in d["steps"]
            if t > kill["time"] and s >= first
        ]
        if after:
            print(f"\nheal timing: kill of rank {kill['rank']} at step {kill['step']} ({kill['phase']}) -> "
                  f"survivors' next committed step: {min(after) - kill['time']:.3f} s")  # fmt: skip
    for r, n in lost.items():
        for g in range(1, n + 1):
            d = found[(r, g)]
            died = (
                [k["time"] for k in kills if k["rank"] == r and k["time"] < d["steps"][0][1]]
                if d["steps"]
                else []
            )
            if died:  # forked from the zygote (loom.launch.zygote): the kill is its start
                print(f"heal timing: rank {r} replacement {g}: kill -> its first trained step "
                      f"{d['steps'][0][1] - max(died):.3f} s")  # fmt: skip
            if d["steps"]:
                print(f"heal timing: rank {r} replacement {g}: process start -> first trained step "
                      f"{d['steps'][0][1] - d['started']:.3f} s (of which the interpreter, imports and loom.init "
                      f"{d['initialized'] - d['started']:.3f} s, joining and receiving the state "
                      f"{d['joined'] - d['initialized']:.3f} s); joined at step {d['joined_at_step']}")  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase", ["before", "during", "after", "commit"])
def test_a_worker_killed_in_each_phase_is_healed_and_the_job_equals_one_process(tmp_path, phase):
    result, out, run_dir = run_heal(tmp_path, f"kill@1:3:{phase}")
    check_healed_job(result, out, run_dir, 10, {1: 1})
    assert "worker rank 1 was killed by SIGKILL; starting its replacement" in result.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_failures_in_a_row(tmp_path):
    result, out, run_dir = run_heal(tmp_path, "kill@1:3:during,kill@2:4:before", steps=10)
    check_healed_job(result, out, run_dir, 10, {1: 1, 2: 1})


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_replacement_that_joins_late_finds_the_others_trained_on_without_it(tmp_path):
    # rank 1's replacement pauses 3 s before it announces it is ready; the others do not wait for it (HEAL_WAIT_S=0,
    # a 0.1 s pause a step): they train steps with two members meanwhile, and it joins at a later step
    result, out, run_dir = run_heal(tmp_path, "kill@1:3:before,slow@1:1:join#1", steps=40, pause_s=0.1,
                                    HEAL_WAIT_S="0", LOOM_FAULTS_SLOW_S="3")  # fmt: skip
    found = check_healed_job(result, out, run_dir, 40, {1: 1})
    late = found[(1, 1)]["joined_at_step"]
    two = [step for step, _t, members, *_ in found[(0, 0)]["steps"] if len(members) == 2]
    assert late >= 5 and len(two) >= 2, (late, two)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_peer_a_replacement_heals_from_dies_while_sending(tmp_path):
    # rank 0 (the first member, so the sender) dies as it starts sending its state to rank 1's replacement
    result, out, run_dir = run_heal(tmp_path, "kill@1:3:during,kill@0:1:send", steps=10)
    check_healed_job(result, out, run_dir, 10, {0: 1, 1: 1})


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase", ["before", "during", "commit"])
def test_an_error_in_a_step_drops_it_on_every_member_and_it_is_retried(tmp_path, phase):
    # "during": rank 2 raises between the exchange's two halves, where the others wait for it in the second; they
    # must fail at once (its group closed), not at the group's timeout, past the launcher's check-in timeout
    # "commit": rank 2 raises after the vote committed step 3 (the others applied it): it must not train that
    # global batch again as step 4; it takes the committed state and goes on with the next batch
    result, out, run_dir = run_heal(tmp_path, f"raise@2:3:{phase}", steps=6)
    check_healed_job(result, out, run_dir, 6, {})
    if phase == "commit":
        assert "step 3 failed after its commit in epoch 1 (InjectedFault" in result.stderr, result.stderr[
            -3000:
        ]
    else:
        assert "step 3 dropped in epoch 1 (InjectedFault" in result.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_past_max_heals_the_job_stops_naming_the_lost_ranks(tmp_path):
    result, _out, _run = run_heal(tmp_path, "kill@1:3:during", "--max-heals", "0", steps=8)
    assert result.returncode == 1
    assert "past --max-heals 0: the job stops (lost: worker rank 1 was killed by SIGKILL)" in result.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_member_lost_while_the_others_form_an_epoch_with_it(tmp_path):
    # rank 1 dies in step 3; rank 2 then dies as it is about to build the group of its second epoch, where rank 0
    # (and rank 1's replacement, if it is listed) wait for it: they must learn of the loss and re-form, not wait in
    # the group's rendezvous until the launcher kills them for not checking in (which lost the job's every step)
    result, out, run_dir = run_heal(tmp_path, "kill@1:3:during,kill@2:2:form", steps=10)
    check_healed_job(result, out, run_dir, 10, {1: 1, 2: 1})
    assert "did not check in" not in result.stderr, result.stderr[-3000:]
