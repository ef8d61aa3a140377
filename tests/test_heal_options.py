"""DataParallel's options under ``--on-worker-failure heal`` (issue 39): the same job, its data axis the quorum.

``accumulate=3``, ``allreduce="ring"`` and ``compression="int8"`` run over each membership epoch's group: with a
worker killed inside the exchange, every committed step is trained once by the members present and the job
equals one process on the same global batches (int8: within its rounding). And a step under heal makes as many
collectives as the same job without heal: one exchange (the gradients, the loss and every mark in one buffer), so
the fault injection (``during`` fires before the exchange, no exchange is split for it) costs nothing."""

from __future__ import annotations

import json

import pytest
from test_heal import check_healed_job, run_heal


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("options", "path", "atol"),
    [
        ({"accumulate": 3}, "'native' all-reduce", 1e-5),
        ({"allreduce": "ring"}, "'ring' all-reduce", 1e-5),
        ({"compression": "int8"}, "compression='int8'", 5e-2),  # int8 rounding of each member's share
    ],
    ids=["accumulate3", "ring", "int8"],
)
def test_data_parallel_options_under_heal_equal_one_process(tmp_path, options, path, atol):
    result, out, run_dir = run_heal(tmp_path, "kill@1:3:during", HEAL_DP_OPTIONS=json.dumps(options))
    assert f"flat gradients over the data axis's group, no DDP ({path})" in result.stderr, result.stderr[
        -3000:
    ]
    check_healed_job(result, out, run_dir, 10, {1: 1}, atol=atol)


def _collectives_per_step(tmp_path, heal: bool, options: dict) -> dict[int, list[int]]:
    where = tmp_path / ("heal" if heal else "plain")
    where.mkdir()
    result, out, _ = run_heal(
        where, "", heal=heal, steps=6, HEAL_COUNT="1", HEAL_DP_OPTIONS=json.dumps(options)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = {
        json.loads(f.read_text())["rank"]: json.loads(f.read_text())["collectives"]
        for f in out.glob("*.json")
    }
    assert sorted(found) == [0, 1, 2] and all(len(c) == 6 for c in found.values()), found
    return found


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_step_under_heal_makes_as_many_collectives_as_without_heal(tmp_path):
    """Counted per step on every rank (heal_train.py's ``count_collectives``: process-group collectives called from
    Python, and shared-memory exchanges). Without heal the default CPU path is the shared-memory one, the loss
    riding along (one exchange); under heal the axis's exchange, one all-reduce of everything (the exchange split
    in two for the fault injection, as before issue 39, counts 2). DDP's paths (compression, ``native``) are not
    compared here: its reducer calls the process group from C++, where this count does not see it."""
    plain = _collectives_per_step(tmp_path, False, {})
    healing = _collectives_per_step(tmp_path, True, {})
    print(f"\ncollectives per step: without heal {plain}, under heal {healing}")
    assert all(counts == [1] * 6 for counts in plain.values()), plain
    assert healing == plain
