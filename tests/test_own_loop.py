"""Own loops (``job.own_loop``): three public training scripts ported in at most 8 changed lines of their loop,
each equal to one process on the same global batches; and the loss-calling conventions of ``train_step``."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import loom
from loom.train.batch import LossCall, forward_loss, model_loss

WORKERS = Path(__file__).parent / "workers"
MAX_CHANGED = 8


def loop_diff(worker: str) -> tuple[int, int, str]:
    """``(added, removed, diff)`` between a worker's ``ORIGINAL_LOOP`` and its ``# >>> port`` block."""
    source = (WORKERS / worker).read_text()
    tree = ast.parse(source)
    original = next(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ORIGINAL_LOOP"
    )
    block = source.split("# >>> port\n", 1)[1].split("# <<< port", 1)[0]
    ported = "\n".join(line for line in block.splitlines() if line.strip() not in ("# fmt: off", "# fmt: on"))
    a = [line.rstrip() for line in textwrap.dedent(original).strip("\n").splitlines()]
    b = [line.split("  # noqa")[0].rstrip() for line in textwrap.dedent(ported).strip("\n").splitlines()]
    diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0) if d[:3] not in ("---", "+++")]
    added = sum(d.startswith("+") for d in diff)
    removed = sum(d.startswith("-") for d in diff)
    return added, removed, "\n".join(diff)


def load_worker(name: str):
    """Import a worker script as a module (its ``main``/``train`` run one process here: the reference)."""
    spec = importlib.util.spec_from_file_location(f"own_loop_ref_{name}", WORKERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def assert_close(
    distributed: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], start=None
) -> None:
    assert distributed.keys() == reference.keys()
    worst = max((distributed[k] - reference[k]).abs().max().item() for k in reference)
    print(f"max |distributed - one process| = {worst:.3g}")
    assert worst < 1e-5
    if start is not None:  # the run trained: a comparison of untouched parameters would prove nothing
        assert max((reference[k] - start[k]).abs().max().item() for k in reference) > 1e-3


@pytest.mark.unit
@pytest.mark.parametrize("worker", ["own_loop_gpt.py", "own_loop_torchrun.py", "own_loop_horovod.py"])
@pytest.mark.timeout(10)
def test_ports_change_at_most_8_lines_of_the_loop(worker):
    added, removed, diff = loop_diff(worker)
    print(f"{worker}: +{added}/-{removed}\n{diff}")
    assert 0 < added + removed <= MAX_CHANGED, diff


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_nanogpt_loop_with_bf16_autocast_clipping_and_grad_scaler(workers, tmp_path):
    out = tmp_path / "gpt.safetensors"
    outputs = workers("own_loop_gpt.py", 2, str(out), "bfloat16", "sgd", timeout=110)
    assert "step 2: train loss" in outputs[0] and "step 0" not in outputs[1]  # rank 0 evaluated alone
    gpt = load_worker("own_loop_gpt")
    gpt.dtype, gpt.OPTIMIZER, gpt.learning_rate = "bfloat16", "sgd", 5e-3
    torch.manual_seed(1337)
    start = {k: v.detach().clone() for k, v in gpt.GPT().state_dict().items()}
    assert_close(load_file(out), gpt.train(), start)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_torchrun_tutorial_trainer_with_snapshots_resumes_at_another_size(workers, tmp_path, monkeypatch):
    snap, out = tmp_path / "snapshot", tmp_path / "final.safetensors"
    workers("own_loop_torchrun.py", 2, str(snap), "2", str(out), timeout=70)
    first = load_file(out)
    outputs = workers(
        "own_loop_torchrun.py", 3, str(snap), "3", str(out), timeout=70
    )  # 50 % 16: a share of 0
    assert "Resuming training from snapshot at Epoch 1" in outputs[0]
    monkeypatch.setenv("LOCAL_RANK", "0")
    tutorial = load_worker("own_loop_torchrun")
    ref_snap = tmp_path / "reference"
    assert_close(first, tutorial.main(str(ref_snap), 2))
    assert_close(load_file(out), tutorial.main(str(ref_snap), 3))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_horovod_mnist_loop(workers, tmp_path):
    out = tmp_path / "mnist.safetensors"
    workers("own_loop_horovod.py", 2, str(out), timeout=110)
    horovod = load_worker("own_loop_horovod")
    torch.manual_seed(42)
    start = horovod.Net().state_dict()
    assert_close(load_file(out), horovod.main(), start)


# -- the loss-calling conventions, one process -------------------------------------------------------------------
class _OwnLoss(nn.Module):
    """A model called as ``model(x, y)`` returning ``(logits, loss)``, like nanoGPT's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        out = self.linear(x)
        return out, nn.functional.mse_loss(out, y)


@pytest.mark.unit
@pytest.mark.timeout(20)
def test_every_convention_trains_the_same_step():
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    mse = nn.functional.mse_loss
    cases = [  # (model, loss_fn, batch): each the same linear model and mean squared error
        (nn.Linear, mse, (x, y)),
        (_OwnLoss, None, (x, y)),
        (nn.Linear, LossCall(lambda out, batch: mse(out, batch[1]), whole_batch=True), (x, y)),
        (nn.Linear, LossCall(mse, unpack_inputs=True), ((x,), y)),
    ]
    losses, weights = [], []
    for make, loss_fn, batch in cases:
        torch.manual_seed(0)
        model = make(3, 2) if make is nn.Linear else make()
        job = loom.DataParallel(topology=loom.Topology(0, 1, 0, 1, "none")).setup(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn
        )
        losses.append(job.train_step(batch))
        weights.append(next(iter(job.module.parameters())).detach().clone())
    assert max(losses) - min(losses) < 1e-6, losses
    assert all(torch.equal(w, weights[0]) for w in weights), weights


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_model_loss_is_found_or_refused_by_name():
    scalar = torch.tensor(2.0)
    assert model_loss(scalar) is scalar and model_loss((torch.ones(2, 2), scalar)) is scalar
    assert model_loss({"loss": scalar, "logits": torch.ones(2)}) is scalar
    with pytest.raises(TypeError, match=r"returned a tensor of shape \(2, 2\).*scalar tensor"):
        model_loss(torch.ones(2, 2))
    with pytest.raises(ValueError, match="unpack_inputs and whole_batch apply to a loss function"):
        LossCall(None, whole_batch=True)
    loss, _ = forward_loss(LossCall(None), lambda **kw: kw["x"].sum(), {"x": torch.ones(3)})
    assert float(loss) == 3.0  # a dict batch goes to model(**batch)


@pytest.mark.unit
@pytest.mark.timeout(20)
def test_model_parallel_strategies_refuse_conventions_they_cannot_run():
    model = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"model-parallel job .* cannot run the model's own loss"):
        loom.Pipeline(topology=loom.Topology(0, 1, 0, 1, "none"), stages=1).setup(
            model, torch.optim.SGD(model.parameters(), lr=0.1), None
        )


@pytest.mark.unit
def test_a_nan_in_a_layer_unfrozen_after_setup_skips_the_step():
    """In one process the own loop judges the gradients of the parameters trainable at each step, not at set-up: a
    fine-tuning loop that unfreezes a layer later is guarded there too (a NaN must not reach the weights)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    job = loom.DataParallel().setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    module, optimizer, loader = job.own_loop(job.loader(data, global_batch_size=8))
    model[0].requires_grad_(True)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(module(x), y).backward()
    model[0].weight.grad[0, 0] = float("nan")
    optimizer.step()
    assert job.last_step_skipped
    assert torch.isfinite(model[0].weight).all()


@pytest.mark.unit
def test_unfreezing_after_setup_across_processes_is_refused_naming_the_fix():
    """Across processes only the set-up's trainable parameters are averaged: a changed set is refused at the step,
    not trained on unaveraged gradients (the review saw ranks diverge silently). Two processes are stood for by
    the job's topology: the refusal is decided before any collective."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    job = loom.DataParallel().setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    module, optimizer, loader = job.own_loop(job.loader(data, global_batch_size=8))
    x, y = next(iter(loader))
    nn.functional.cross_entropy(module(x), y).backward()
    job.topology = dataclasses.replace(job.topology, world_size=2)
    model[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"rank 0: own loop step .*require grad changed after setup .*HINT: set "
                       r"requires_grad before strategy.setup"):  # fmt: skip
        optimizer.step()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
