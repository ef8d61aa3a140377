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
