"""Horovod elastic on loom's restarts: a worker SIGKILLed mid-epoch under ``loom run --max-restarts 1``; the
job resumes from the last ``state.commit()`` and ends where an uninterrupted run ends."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_launcher import run_loom, wait_until_gone

WORKER = Path(__file__).parent / "workers" / "horovod_elastic.py"


def reference() -> dict[str, torch.Tensor]:
    """One process, the whole global batch at every step, no failure."""
    spec = importlib.util.spec_from_file_location("horovod_elastic_ref", WORKER)
    w = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(w)  # type: ignore[union-attr]
    model = w.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(w.EPOCHS):
        for index in range(w.BATCHES):
            x, y = w.batch(epoch, index)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return model.state_dict()


@pytest.mark.system
@pytest.mark.timeout(150)
def test_killed_worker_resumes_from_the_last_commit(tmp_path):
    out = tmp_path / "params.safetensors"
    result = run_loom(
        ["run", "-n", 2, "--max-restarts", 1, "--run-dir", tmp_path / "run", WORKER, out],
        tmp_path,
        timeout=140,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert wait_until_gone(str(WORKER)) == []
    lines = [line.split("]: ", 1)[-1] for line in result.stdout.splitlines()]
    starts = [tuple(int(v) for v in line.split()[1:]) for line in lines if line.startswith("START")]
    # attempt 0 starts at the beginning; attempt 1 at the commit after epoch 1, batch 1 (killed before batch 3)
    assert starts == [(0, 0, 0), (1, 1, 2)], result.stdout
    assert [line for line in lines if line.startswith("RESET")] == ["RESET 1"]
    restart = [line for line in result.stderr.splitlines() if "restarting the worker group" in line]
    assert len(restart) == 1 and "killed by SIGKILL" in restart[0], result.stderr[-3000:]
    got, want = load_file(out), reference()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print(
        f"elastic: resumed at epoch 1 batch 2 after SIGKILL; final params vs uninterrupted one process: {worst:.3g}"
    )
    assert worst < 1e-6


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_commit_is_one_safetensors_file_that_round_trips_tied_tensors(tmp_path):
    from safetensors import safe_open

    from loom.horovod.elastic import _read_commit, _write_commit

    assert _read_commit(tmp_path) is None
    shared = torch.arange(6.0)
    payload = {"epoch": 3, "pair": (1, "a"), "tied": [shared, shared.view(2, 3)], "none": None}
    _write_commit(tmp_path, payload)
    _write_commit(tmp_path, payload)  # replaced whole, no leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["commit.safetensors"]
    with safe_open(str(tmp_path / "commit.safetensors"), "pt") as f:
        assert "tree" in f.metadata()
    back = _read_commit(tmp_path)
    assert back["epoch"] == 3 and back["pair"] == (1, "a") and back["none"] is None
    assert torch.equal(back["tied"][0], shared) and torch.equal(back["tied"][1], shared.view(2, 3))


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_commit_without_its_tree_names_the_file_and_the_fix(tmp_path):
    from safetensors.torch import save_file

    from loom.errors import CheckpointError
    from loom.horovod.elastic import _read_commit

    save_file({"0": torch.zeros(2)}, str(tmp_path / "commit.safetensors"))  # an older loom's: no metadata
    with pytest.raises(
        CheckpointError, match=r"commit.safetensors is not a loom.horovod commit.*HINT: delete"
    ):
        _read_commit(tmp_path)
