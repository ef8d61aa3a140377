"""Memory in the step records (`loom.observe.memory`, the engine's sampling) and in ``loom report``'s table.

One process, ``topology=SINGLE``: the records of a real job, against the byte counts its model and Adam must have.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import loom
from loom.observe.memory import live_tensor_bytes, peak_rss_bytes, reset_peak_rss, state_bytes
from loom.observe.metrics import StepMetrics
from loom.observe.report import _memory_table, summarize
from loom.topology import Topology

SINGLE = Topology(0, 1, 0, 1, "none")
MIB = 2**20
BIG = 256 * MIB  # a temporary that a step allocates and touches: the peak must see it


def make_job(tmp_path, big_at: int = 0, **options):
    """A one-process job whose loss, at step ``big_at``, allocates and touches BIG bytes it frees at once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    path = tmp_path / "rank0.jsonl"
    calls = []

    def loss_fn(out, target):
        calls.append(1)
        if len(calls) == big_at:
            transient = torch.ones(BIG // 4)
            del transient
        return nn.functional.mse_loss(out, target)

    job = loom.DataParallel(topology=SINGLE, metrics_path=str(path), **options).setup(
        model, torch.optim.Adam(model.parameters()), loss_fn
    )
    return job, model, path


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_sampled_steps_carry_the_training_state_and_the_step_peak(tmp_path):
    """Steps 1, 2 and every memory_every-th carry memory; the state is what the model and Adam hold (4 bytes a
    parameter for each of parameters, gradients, and 8 for Adam's two moments, plus its step counters); a step
    that allocates BIG bytes shows them in its peak, and a later step's peak, reset at its start, does not."""
    big_at = 2
    job, model, path = make_job(tmp_path, big_at=big_at)
    job.memory_every = 4
    n = sum(p.numel() for p in model.parameters())
    for batch in batches(6):
        job.train_step(batch)
    job.metrics.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records if "memory" in r] == [1, 2, 4]
    for r in records:
        if "memory" not in r:
            assert "peak_rss_bytes" not in r
            continue
        memory = r["memory"]
        assert memory["parameters"] == 4 * n and memory["gradients"] == 4 * n, memory
        assert 8 * n <= memory["optimizer"] <= 8 * n + 64 * len(list(model.parameters())), memory
        assert memory["state"] == memory["parameters"] + memory["gradients"] + memory["optimizer"]
        assert r["peak_rss_bytes"] >= r["rss_bytes"] > 0
    by_step = {r["step"]: r for r in records}
    rise = {s: by_step[s]["peak_rss_bytes"] - by_step[s]["rss_bytes"] for s in (1, 2, 4)}
    assert rise[big_at] >= 0.9 * BIG, rise  # the transient inside the step's forward
    assert rise[4] < BIG // 4, rise  # a later plain step: the peak was reset at its start (else it keeps BIG)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_peak_is_reset_at_each_sampled_step():
    """A transient allocation inside a step raises that step's peak; a later reset forgets it (the reason the
    records use ``/proc/self/clear_refs`` and not ``ru_maxrss``, which only grows)."""
    if not reset_peak_rss():
        pytest.fail("/proc/self/clear_refs is not writable here: the peak cannot be reset")
    before = peak_rss_bytes()
    transient = torch.ones(BIG // 4)
    del transient
    high = peak_rss_bytes()
    assert high is not None and before is not None and high - before >= BIG * 0.9
    assert reset_peak_rss()
    low = peak_rss_bytes()
    assert low is not None and low < high - BIG // 2


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_memory_every_zero_samples_nothing_and_state_bytes_agrees_with_the_heap_walk(tmp_path):
    job, model, path = make_job(tmp_path)
    job.memory_every = 0
    for batch in batches(3):
        job.train_step(batch)
    job.metrics.close()
    assert not any("memory" in json.loads(line) for line in path.read_text().splitlines())
    cheap, walked = state_bytes(model, job.optimizer), job.memory()
    assert walked == live_tensor_bytes(model, job.optimizer)
    for category in ("parameters", "gradients", "optimizer", "state"):
        assert cheap[category] == walked[category], category


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_annotate_rewrites_a_record_already_written(tmp_path):
    path = tmp_path / "m.jsonl"
    metrics = StepMetrics(0, path)
    metrics.record(1, 0.1, 4, 4, 1.0)
    metrics.flush()
    assert metrics.annotate(1, rss_bytes=123)
    assert not metrics.annotate(7, rss_bytes=1)  # not the latest step: nothing
    with pytest.raises(TypeError, match="no field"):
        metrics.annotate(1, not_a_field=1)
    metrics.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2 and lines[-1]["rss_bytes"] == 123 and lines[-1]["step"] == 1


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_report_table_shows_each_rank_state_and_highest_peak():
    def rec(step, rank, **extra):
        return {
            "step": step,
            "rank": rank,
            "time_s": 0.1,
            "samples": 2,
            "global_samples": 4,
            "loss": 1.0,
            **extra,
        }

    state = {"parameters": 4 * MIB, "gradients": 2 * MIB, "optimizer": MIB, "state": 7 * MIB}
    runs = {
        r: [
            rec(1, r, memory=state, rss_bytes=100 * MIB, peak_rss_bytes=(150 + r) * MIB),
            rec(2, r, memory=state, rss_bytes=110 * MIB, peak_rss_bytes=(130 + r) * MIB),
            rec(3, r),
        ]
        for r in (0, 1)
    }
    summary = summarize(runs, None)
    rows = summary["memory"]
    assert [row["rank"] for row in rows] == [0, 1]
    assert rows[1]["peak_step"] == 1 and rows[1]["peak_rss_mb"] == 151 and rows[1]["step_rise_mb"] == 51
    assert rows[0]["state_mb"] == 7 and rows[0]["sampled_steps"] == 2
    table = _memory_table(rows)
    assert 'id="memory"' in table and "151.00" in table and "training state MiB" in table
    assert "no memory samples" in _memory_table([])
