"""Resize on resume: a job checkpointed by 4 workers resumes on 2 and ends where the 4-worker run ends."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.multiprocess


def launch(workers, world_size: int, *runs: str) -> dict[str, list[dict]]:
    """Run tests/workers/resize_fit.py with one argument per run; the JSON records by run directory name."""
    results: dict[str, list[dict]] = {}
    for out in workers("resize_fit.py", world_size, *runs, timeout=60):
        for line in out.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                results.setdefault(record["dir"].rsplit("/", 1)[-1], []).append(record)
    return results


def max_difference(a: dict, b: dict) -> float:
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


@pytest.mark.timeout(120)
def test_four_workers_saved_two_resumed_match_the_four_worker_run(tmp_path, workers):
    # 4 workers: the uninterrupted reference, and a run stopped at step 6 (checkpointed at 3 and 6).
    first = launch(workers, 4, f"{tmp_path}/straight:12", f"{tmp_path}/resized:6")
    assert [r["steps"] for r in first["resized"]] == [6] * 4
    shutil.copytree(tmp_path / "resized", tmp_path / "scaled")
    # 2 workers resume it: the loader continues at global sample 60, the learning rate is left alone (the
    # global batch does not change with the world size) unless the linear scaling rule is asked for.
    second = launch(workers, 2, f"{tmp_path}/resized:12", f"{tmp_path}/scaled:7:scale")
    reference = first["straight"][0]
    for record in second["resized"]:
        assert (record["world"], record["steps"], record["resumed_from"]) == (2, 12, 6)
        difference = max_difference(record["params"], reference["params"])
        assert difference <= 1e-5, f"rank {record['rank']}: {difference}"
        assert abs(record["loss"] - reference["loss"]) <= 1e-5
        assert record["lr"] == pytest.approx(reference["lr"]) == pytest.approx(0.1 * 0.5**3)
    for record in second["scaled"]:
        # StepLR(4, 0.5) after 7 steps gives 0.05; resumed on 2 of 4 workers: times 2/4.
        assert record["lr"] == pytest.approx(0.05 * 2 / 4)
    print(f"resize 4->2: max parameter difference {difference:.2e} from the 4-worker run")
