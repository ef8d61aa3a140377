"""Measured pipeline bubble and activation liveness with stages that sleep a fixed time per micro-batch.

The textbook bubble ``(p - 1) / (m + p - 1)`` assumes free messages. Each message costs ~0.3 ms on a quiet
machine and a few ms when other processes compete for the cores (a blocked receive wakes up late), and 1F1B's
steady state has about two messages per micro-batch on its critical path (GPipe with p = 2 has two per step).
Messages only ever add idle time, so the measurement must lie between the textbook bubble and the schedule
replayed by `simulate` with the one-way message time measured in the same run (a ping-pong just before the
steps, which under load tends to cost more than the pipeline's own messages), 10 % of the textbook value either
side. With no message cost the replay is exactly the textbook bubble (tests/test_pipeline_schedule.py).
"""

import json

import pytest

from loom.parallel.pipeline.pipeline_schedule import bubble_fraction, simulate

# `alone`: a message must cost under a tenth of a stage (below); `make test` runs this after its parallel run.
pytestmark = [pytest.mark.multiprocess, pytest.mark.alone]

# Long enough that the stage time dominates a message's cost; the check below refuses a machine so loaded that
# a message costs a tenth of a stage's time, where the comparison would say little.
SLEEP_S = 0.06


@pytest.mark.timeout(170)
@pytest.mark.parametrize("stages", [2, 4])
def test_measured_bubble_matches_theory(workers, stages):
    outputs = workers("pp_bubble.py", stages, str(SLEEP_S), timeout=160)
    per_rank: dict[tuple[str, int], list[list[dict]]] = {}
    shares: dict[tuple[str, int], list[float]] = {}
    for rank, out in enumerate(outputs):
        for line in out.splitlines():
            run = json.loads(line)
            label = f"rank {rank} p={stages} {run['schedule']} m={run['m']}"
            assert run["message_s"] < 0.1 * SLEEP_S, (
                f"{label}: machine too loaded, a message took {run['message_s']}s"
            )
            theory = bubble_fraction(stages, run["m"])
            replay = simulate(run["schedule"], stages, run["m"], SLEEP_S, SLEEP_S, run["message_s"])
            low, high = 0.9 * theory, replay.bubble + 0.1 * theory
            assert low <= run["bubble"] <= high, (
                f"{label}: {run['bubble']:.4f} outside [{low:.4f}, {high:.4f}] (textbook {theory:.4f},"
                f" replayed with {run['message_s'] * 1e3:.2f} ms messages {replay.bubble:.4f})"
            )
            # GPipe holds every micro-batch until the backwards start; 1F1B at most p - stage of them.
            peak = run["m"] if run["schedule"] == "gpipe" else min(run["m"], stages - rank)
            assert run["peak_live"] == peak, label
            per_rank.setdefault((run["schedule"], run["m"]), []).append(run["per_step"])
            shares.setdefault((run["schedule"], run["m"]), []).append(1 - replay.busy[rank] / replay.makespan)
    assert all(len(ranks) == stages for ranks in per_rank.values())
    for (schedule, m), ranks in per_rank.items():
        label = f"p={stages} {schedule} m={m}"
        check_step_records_carry_the_bubble(ranks, shares[(schedule, m)], bubble_fraction(stages, m), label)


def check_step_records_carry_the_bubble(
    ranks: list[list[dict]], expected_shares: list[float], theory: float, label: str
) -> None:
    """Every rank's step record has ``bubble_s``, and the ranks' values add up to the gathered bubble."""
    for k, steps in enumerate(zip(*ranks, strict=True)):
        for rank, step in enumerate(steps):
            # with p >= 2 every stage waits (p - 1) forward+backward times per step, whatever m is
            assert step["bubble_s"] is not None and 0 < step["bubble_s"] < step["time_s"], (label, k, rank)
        # busy + idle is the pipeline's span on every stage, and Σ idle / (p · span) is the measured bubble
        spans = [s["busy_s"] + s["bubble_s"] for s in steps]
        assert max(spans) - min(spans) <= 1e-9 * max(spans), (label, k, spans)
        from_records = sum(s["bubble_s"] for s in steps) / (len(steps) * spans[0])
        assert abs(from_records - steps[0]["bubble"]) <= 1e-9, (label, k, from_records, steps[0]["bubble"])
    # In the best step each stage idles its share of the span: (p - 1) of its m + p - 1 slots when messages are
    # free, at most its share in the replay with the measured message time (some stages wait for more of them).
    best = min(range(len(ranks[0])), key=lambda k: ranks[0][k]["bubble"])
    for rank, steps in enumerate(ranks):
        step = steps[best]
        share = step["bubble_s"] / (step["busy_s"] + step["bubble_s"])
        low, high = 0.85 * theory, expected_shares[rank] + 0.15 * theory
        assert low <= share <= high, f"{label} rank {rank}: {share:.4f} outside [{low:.4f}, {high:.4f}]"
