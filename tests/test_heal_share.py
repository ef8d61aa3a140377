"""Under ``--on-worker-failure heal`` each member loads only its share of each global batch (issue 39, item 1).

heal_train.py with ``HEAL_COUNT_SAMPLES=1`` serves its samples one ``__getitem__`` at a time and logs, per step,
the dataset indices each process fetched, one list per fetch. With 3 members and rank 1 killed inside step 3's
exchange: every attempt of every step fetched exactly this member's share of that global batch among the
members of the attempt (`share_bounds`), and nothing else; the survivors' retry of step 3 fetched their share
among the new members; the replacement fetched its share from its first step; and the job still equals one
process on the same global batches (`check_healed_job`, 1e-5)."""

from __future__ import annotations

import pytest
from test_heal import GLOBAL_BATCH, SAMPLES, check_healed_job, global_size, run_heal

from loom.data.sampler import GlobalBatchSampler, share_bounds

SAMPLER = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=0)  # heal_train.py's loader: seed 0, shuffled


def share(step: int, members: list[int], rank: int) -> list[int]:
    """The dataset indices of ``rank``'s share of the global batch of ``step`` (1-based) among ``members``."""
    epoch, k = divmod(step - 1, SAMPLER.steps_per_epoch())
    batch = SAMPLER.order(epoch)[k * GLOBAL_BATCH : k * GLOBAL_BATCH + global_size(step)]
    lo, hi = share_bounds(len(batch), members.index(rank), len(members))
    return batch[lo:hi].tolist()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_each_member_fetches_only_its_share_of_each_attempt_and_the_job_equals_one_process(tmp_path):
    # the replacement announces itself 2 s late, so the survivors retry step 3 without it (another membership)
    result, out, run_dir = run_heal(tmp_path, "kill@1:3:during,slow@1:1:join#1", HEAL_COUNT_SAMPLES="1",
                                    LOOM_FAULTS_SLOW_S="2")  # fmt: skip
    found = check_healed_job(result, out, run_dir, 10, {1: 1})
    served = []
    for (rank, gen), report in sorted(found.items()):
        steps, fetched = report["steps"], report["fetched"]
        assert len(fetched) == len(steps), (rank, gen)
        for i, ((step, _t, members, *_), fetches) in enumerate(zip(steps, fetched, strict=True)):
            served.append(sum(map(len, fetches)))
            assert fetches[-1] == share(step, members, rank), (rank, gen, step, members, fetches)
            if step == 3 and gen == 0:  # the attempt that met the kill (members of step 2), then the retry
                before = steps[i - 1][2]
                assert before == [0, 1, 2] and len(fetches) == 2, (rank, fetches)
                assert fetches[0] == share(3, before, rank), (rank, fetches)
            else:
                assert len(fetches) == 1, (rank, gen, step, fetches)
    retry = {
        tuple(m) for (r, g), d in found.items() if g == 0 and r != 1 for s, _t, m, *_ in d["steps"] if s == 3
    }
    assert retry == {(0, 2)}, retry  # so each survivor's two fetches of step 3 differ: 4 samples, then 6
    print(f"\nsamples fetched per member per step: {sum(served) / len(served):.2f} (global batch {GLOBAL_BATCH}, "
          "3 members)")  # fmt: skip
