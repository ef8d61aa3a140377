"""loom.horovod: Horovod's PyTorch API. Collectives against torch.distributed and hand-computed results on 2
processes; DistributedOptimizer with backward_passes_per_step=2 against one process on the same global batch;
the safe object encoding; one process without a launcher."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loom.horovod import _objects

WORKERS = Path(__file__).parent / "workers"
SRC = Path(__file__).parents[1] / "src"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_every_collective_matches_torch_distributed_on_two_processes(workers):
    outs = workers("horovod_collectives.py", 2, timeout=110)
    counts = [int(out.split("CHECKED")[1]) for out in outs]
    assert counts[0] == counts[1] and counts[0] > 60, outs


def optimizer_worker():
    spec = importlib.util.spec_from_file_location("horovod_optimizer_ref", WORKERS / "horovod_optimizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def reference_parameters() -> dict[str, torch.Tensor]:
    """One process, plain torch, the whole global batch per step: what DistributedOptimizer must equal."""
    w = optimizer_worker()
    model = w.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = w.data()
    for step in range(w.STEPS):
        batch = slice(step * w.GLOBAL_BATCH, (step + 1) * w.GLOBAL_BATCH)
        xs, ys = x[batch], y[batch]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worst_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_distributed_optimizer_with_two_backward_passes_equals_one_process(workers, tmp_path):
    out = tmp_path / "params.safetensors"
    workers("horovod_optimizer.py", 2, str(out), timeout=110)
    reference = reference_parameters()
    start = optimizer_worker().make_model().state_dict()
    worst = worst_difference(load_file(out), reference)
    print(f"DistributedOptimizer(backward_passes_per_step=2), 2 processes vs one: max |diff| = {worst:.3g}")
    assert worst < 1e-6
    assert worst_difference(reference, start) > 1e-2  # it trained


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_fp16_compression_trains_close_to_one_process(workers, tmp_path):
    out = tmp_path / "params.safetensors"
    workers("horovod_optimizer.py", 2, str(out), "fp16", timeout=110)
    worst = worst_difference(load_file(out), reference_parameters())
    print(f"fp16 compression vs one process (float32): max |diff| = {worst:.3g}")
    assert 0 < worst < 5e-3  # float16 gradients: close, and not bit-equal


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_one_process_without_a_launcher(tmp_path):
    """Plain ``python train.py``: hvd.init() makes a job of one, and the optimizer equals plain torch."""
    out = tmp_path / "params.safetensors"
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, str(WORKERS / "horovod_optimizer.py"), str(out)], check=True, env=env,
                   timeout=50)  # fmt: skip
    assert worst_difference(load_file(out), reference_parameters()) < 1e-6


@pytest.mark.unit
def test_objects_round_trip_and_refusals():
    obj = {"lr": 0.1, "betas": (0.9, 0.999), 3: [None, True, {1, 2}], "t": torch.arange(6.0).view(2, 3),
           "nan": float("nan"), "dtype": torch.float16, "$": "not a tag"}  # fmt: skip
    back = _objects.from_bytes(_objects.to_bytes(obj))
    assert (
        back["betas"] == (0.9, 0.999) and back[3] == [None, True, {1, 2}] and back["dtype"] is torch.float16
    )
    assert torch.equal(back["t"], obj["t"]) and back["nan"] != back["nan"] and back["$"] == "not a tag"

    class Custom:
        pass

    with pytest.raises(TypeError, match=r"obj\['x'\]\[0\].*Custom.*never pickle"):
        _objects.to_bytes({"x": [Custom()]})

    # a header declaring more tensor bytes than arrived, a negative dimension or an unknown dtype is refused
    # before anything is allocated (a 100-byte payload once asked for 4 TiB)
    import json

    for dtype, shape in (
        ("float32", [2**40]),
        ("float32", [-1, 4]),
        ("manual_seed", [1]),
        ("float32", [1.5]),
    ):
        header = json.dumps({"tree": None, "tensors": [[dtype, shape]]}).encode()
        with pytest.raises(ValueError, match="not within the"):
            _objects.from_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
