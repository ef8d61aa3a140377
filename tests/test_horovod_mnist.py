"""Horovod's MNIST example (src/loom/examples/horovod_mnist.py, scikit-learn's digits) under ``loom run -n 2``
with only the import changed, against the same script as one process: the same accuracy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_launcher import run_loom

import loom.examples

EXAMPLE = Path(loom.examples.__file__).parent / "horovod_mnist.py"
ARGS = ["--epochs", "15", "--lr", "0.1", "--log-interval", "100"]


def accuracies(stdout: str) -> list[float]:
    return [float(x) / 100 for x in re.findall(r"Accuracy: ([0-9.]+)%", stdout)]


@pytest.mark.unit
def test_only_the_import_line_names_loom():
    code = EXAMPLE.read_text().split('"""', 2)[2]  # after the module docstring
    assert [line for line in code.splitlines() if "loom" in line] == ["import loom.horovod as hvd"]
    assert "hvd.DistributedOptimizer(" in code and "hvd.broadcast_parameters(" in code


@pytest.mark.system
@pytest.mark.timeout(150)
def test_two_processes_reach_the_accuracy_of_one(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run(
        [sys.executable, str(EXAMPLE), *ARGS], capture_output=True, text=True, timeout=70, env=env
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_loom(["run", "-n", 2, "--run-dir", tmp_path / "run", EXAMPLE, *ARGS], tmp_path, timeout=70)
    assert two.returncode == 0, two.stderr[-3000:]
    acc1, acc2 = accuracies(one.stdout)[-1], accuracies(two.stdout)[-1]
    assert len(accuracies(two.stdout)) == 15  # rank 0 prints the test after every epoch
    print(f"digits test accuracy after 15 epochs: one process {acc1:.4f}, loom run -n 2 {acc2:.4f}")
    assert acc1 > 0.93 and acc2 > 0.93
    assert abs(acc1 - acc2) < 0.03
