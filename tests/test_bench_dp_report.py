"""`loom bench dp`'s figures: medians, paired ratios and scaling efficiency from the worker's samples/s, and the
command line's options."""

import pytest

from loom.cli import main
from loom_bench.data_parallel import markdown, summarize
from loom_bench.dp_worker import MODELS, bench_model, parameter_count

pytestmark = pytest.mark.unit


def test_summary_pairs_each_repetition_with_its_own_ddp_and_one_process_run():
    samples = {
        "loom": [2.0, 4.0, 6.0],
        "loom_unobserved": [3.0, 3.0, 3.0],
        "ddp": [1.0, 4.0, 3.0],
        "one_process": [1.0, 2.0, 10.0],
    }
    r = summarize(samples, nproc=2, repetitions=3, steps=10, model="1.9m", command="loom bench dp -n 2")
    assert r["median_samples_per_s"]["loom"] == 4.0
    assert r["medians_ratio"]["loom_over_ddp"] == pytest.approx(4 / 3)  # medians 4 and 3
    assert r["paired"]["loom_over_ddp"] == pytest.approx(2.0)  # ratios 2, 1, 2
    assert r["paired"]["loom_unobserved_over_ddp"] == pytest.approx(1.0)  # ratios 3, 0.75, 1
    assert r["paired"]["loom_over_loom_unobserved"] == pytest.approx(4 / 3)  # ratios 2/3, 4/3, 2
    assert r["scaling_efficiency_paired"]["loom"] == pytest.approx(1.0)  # 2/2, 4/4, 6/20
    assert r["host"]["cores"] and r["host"]["torch"]
    text = markdown(r)
    assert "| loom DataParallel (defaults) | 4 | 2.000 | 1.00 |" in text
    assert "`loom bench dp -n 2`" in text and "costs **-33.33 %**" in text


def test_summary_refuses_unpaired_repetitions():
    with pytest.raises(ValueError, match="unpaired"):
        summarize({"loom": [1.0, 2.0], "loom_unobserved": [1.0, 2.0], "ddp": [1.0]}, 2, 2, 1)


def test_model_sizes_are_what_their_names_say():
    for size, millions in (("1.9m", 1.9), ("25m", 25), ("100m", 100)):
        assert parameter_count(size) == pytest.approx(millions * 1e6, rel=0.05)
    assert sum(p.numel() for p in bench_model("1.9m").parameters()) == parameter_count("1.9m")
    assert set(MODELS) == {"1.9m", "25m", "100m"}


def test_options_that_do_not_apply_are_refused(capsys):
    assert main(["bench", "checkpoint", "-n", "4"]) == 2
    assert "HINT" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--model", "25m"]) == 2
    assert main(["bench", "dp", "-n", "1"]) == 2  # refused before any process starts
    with pytest.raises(SystemExit):
        main(["bench", "dp", "--model", "7m"])


def test_matrix_table_has_a_row_per_cell_sorted_and_lists_skipped_cells():
    from loom_bench.dp_matrix import matrix_markdown

    cells = []
    for model, n in (("25m", 2), ("1.9m", 4), ("1.9m", 2)):
        samples = {"loom": [2.0, 2.0], "loom_unobserved": [2.0, 2.0], "ddp": [1.0, 1.0]}
        cells.append(summarize(samples, n, 2, 3, model=model))
    text = matrix_markdown(cells, ["100m at 2 workers: skipped, 10 s left of the budget (cap 40 s)"])
    rows = [line for line in text.splitlines() if line.startswith("| 1.9m") or line.startswith("| 25m")]
    assert [row.split(" | ")[:2] for row in rows] == [["| 1.9m", "2"], ["| 1.9m", "4"], ["| 25m", "2"]]
    assert "**2.000**" in rows[0] and "| - |" in rows[0]  # no one-process baseline: no scaling
    assert "- 100m at 2 workers: skipped" in text


def test_phase_table_sets_loom_phases_beside_ddp_laps():
    samples = {"loom": [2.0], "loom_unobserved": [2.0], "ddp": [1.0]}
    samples["phases"] = {
        "loom": {
            "data_s": 0.001,
            "compute_s": 0.010,
            "comm_s": 0.002,
            "optimizer_s": 0.003,
            "record_s": 0.016,
            "wall_s": 0.0161,
            "outside_s": 0.0001,
        },  # fmt: skip
        "ddp": {"forward_s": 0.004, "backward_with_allreduce_s": 0.011, "optimizer_s": 0.003},
    }
    text = markdown(summarize(samples, 2, 1, 3))
    assert "| forward + backward | 10.00 | 15.00 |" in text
    assert "| exchange, blocked | 2.00 | (in backward) |" in text and "| step | 16.10 | 18.00 |" in text
