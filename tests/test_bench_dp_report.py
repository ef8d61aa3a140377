"""`loom bench dp`'s figures: ratio of medians, paired ratios and scaling efficiency from the workers' samples/s."""

import pytest

from loom_bench.data_parallel import _markdown, summarize

pytestmark = pytest.mark.unit


def test_summary_pairs_each_repetition_with_its_own_ddp_run():
    multi = {"loom": [2.0, 4.0, 6.0], "loom_unobserved": [3.0, 3.0, 3.0], "ddp": [1.0, 4.0, 3.0]}
    single = {"ddp": [1.0, 2.0, 10.0]}
    r = summarize(multi, single, nproc=2, repetitions=3, steps=10)
    assert r["loom_over_ddp"] == pytest.approx(4 / 3)  # medians 4 and 3
    assert r["paired_over_ddp"]["loom"] == pytest.approx(2.0)  # ratios 2, 1, 2
    assert r["paired_over_ddp"]["loom_unobserved"] == pytest.approx(1.0)  # ratios 3, 0.75, 1
    assert r["scaling_efficiency"]["loom"] == pytest.approx(4 / (2 * 2))
    text = _markdown(r)
    assert "| loom DataParallel | 4 | 1.333 | 2.000 | 1.00 |" in text


def test_summary_refuses_unpaired_repetitions():
    with pytest.raises(ValueError):
        summarize({"loom": [1.0, 2.0], "loom_unobserved": [1.0, 2.0], "ddp": [1.0]}, {"ddp": [1.0]}, 2, 2, 1)
