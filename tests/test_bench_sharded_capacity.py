"""``python -m loom_bench.sharded_capacity``'s search and report, without processes or cgroups (the benchmark
itself runs 4-process jobs in a memory cgroup: benchmarks/reports/sharded_capacity.md)."""

from __future__ import annotations

import pytest

from loom_bench.sharded_capacity import markdown, search_largest


@pytest.mark.unit
@pytest.mark.timeout(10)
@pytest.mark.parametrize("limit", [512, 1000, 1777, 5000])
def test_search_finds_the_largest_width_that_fits_within_the_resolution(limit):
    tried = []

    def fits(width: int) -> bool:
        tried.append(width)
        return width <= limit

    found = search_largest(fits, 512, 0.05)
    assert found <= limit and fits(found)
    assert limit - found <= max(16, 0.05 * found) or not fits(found + 16), (limit, found, tried)
    assert len(tried) < 20


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_search_refuses_a_start_that_does_not_fit():
    with pytest.raises(RuntimeError, match="start lower"):
        search_largest(lambda w: w < 100, 512, 0.05)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_report_states_the_limit_and_the_ratio():
    def row(strategy, width, params):
        return {"strategy": strategy, "width": width, "params": params, "fits": True, "peak_rss": [2**30] * 4}

    summary = {
        "date": "d", "machine": "m", "command": "python -m loom_bench.sharded_capacity", "limit_bytes": 3 * 2**30,
        "resolution": 0.05, "largest": {"dp": row("dp", 1000, 10e6), "stage3": row("stage3", 2000, 40e6)},
        "trials": [row("dp", 1000, 10e6), {**row("dp", 1400, 20e6), "fits": False}],
    }  # fmt: skip
    text = markdown(summary)
    assert "cgroup limit of **3 GiB**" in text and "4.00x" in text and "**met** (4.00x" in text
    assert "dp 1400: OOM" in text
