"""loom.fit: a run interrupted and resumed from its checkpoints ends exactly where an uninterrupted one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_workers
from torch import nn
from workers.common import make_dataset

import loom
from loom.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    local_state_file,
    pack_state,
    read_local_state,
    save_checkpoint,
)
from loom.topology import Topology
from loom.train.fit import FitResult, fit

SINGLE = Topology(0, 1, 0, 1, "none")


def make_run(global_batch: int = 10):
    """A fresh job (dropout, so the RNG matters), loader and LR scheduler, as a restarted script builds them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    job = loom.DataParallel(topology=SINGLE).setup(model, optimizer, nn.functional.mse_loss)
    loader = loom.data.loader(make_dataset(), global_batch, seed=1, topology=SINGLE)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    torch.manual_seed(42)  # the state a restarted script is in when fit() starts: not the saved one
    return job, loader, scheduler


def assert_same_training_state(a, b):
    for (name, x), y in zip(a.module.state_dict().items(), b.module.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    for state_a, state_b in zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True):
        for key in state_a:
            assert torch.equal(state_a[key], state_b[key]), key
    assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]


class Crash(RuntimeError):
    pass


def crash_at(job, step: int):
    """Make ``job.train_step`` raise when it is about to take step ``step`` (fault injection)."""
    train_step = job.train_step

    def failing(batch):
        if job.step + 1 == step:
            raise Crash(f"injected failure at step {step}")
        return train_step(batch)

    job.train_step = failing


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_resume_in_one_process_is_bitwise_equal(tmp_path, async_checkpoint):
    straight, loader, scheduler = make_run()
    result = fit(straight, loader, steps=20, lr_scheduler=scheduler, progress=False)
    assert result == FitResult(
        steps=20, epochs=5, last_loss=result.last_loss, resumed_from=None, steps_run=20
    )

    job, loader, scheduler = make_run()
    first = fit(
        job,
        loader,
        steps=10,
        checkpoint_dir=tmp_path,
        checkpoint_every=4,
        lr_scheduler=scheduler,
        async_checkpoint=async_checkpoint,
        progress=False,
    )
    assert (first.steps, first.resumed_from) == (10, None)
    assert list(list_checkpoints(tmp_path)) == [4, 8, 10]

    job, loader, scheduler = make_run()
    second = fit(
        job,
        loader,
        steps=20,
        checkpoint_dir=tmp_path,
        checkpoint_every=4,
        keep=2,
        lr_scheduler=scheduler,
        async_checkpoint=async_checkpoint,
        progress=False,
    )
    assert (second.steps, second.resumed_from, second.steps_run, second.epochs) == (20, 10, 10, 5)
    assert second.last_loss == result.last_loss
    assert_same_training_state(straight, job)
    assert list(list_checkpoints(tmp_path)) == [16, 20]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_crash_then_resume_from_the_last_checkpoint(tmp_path):
    straight, loader, scheduler = make_run()
    fit(straight, loader, steps=14, lr_scheduler=scheduler, progress=False)

    job, loader, scheduler = make_run()
    crash_at(job, 11)
    with pytest.raises(Crash):
        fit(
            job,
            loader,
            steps=14,
            checkpoint_dir=tmp_path,
            checkpoint_every=3,
            lr_scheduler=scheduler,
            progress=False,
        )
    assert load_checkpoint(tmp_path)[0] == 9

    job, loader, scheduler = make_run()
    result = fit(
        job,
        loader,
        steps=14,
        checkpoint_dir=tmp_path,
        checkpoint_every=3,
        lr_scheduler=scheduler,
        progress=False,
    )
    assert (result.resumed_from, result.steps_run) == (9, 5)
    assert_same_training_state(straight, job)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_epochs_resume_at_an_epoch_boundary(tmp_path, capsys):
    straight, loader, _ = make_run()
    assert fit(straight, loader, epochs=3, progress=False).steps == 12  # 37 samples, batches of 10

    job, loader, _ = make_run()
    fit(job, loader, steps=4, checkpoint_dir=tmp_path, progress=False)  # stops on the last batch of epoch 0
    job, loader, _ = make_run()
    result = fit(job, loader, epochs=3, checkpoint_dir=tmp_path, log_every=4)
    assert (result.steps, result.epochs, result.resumed_from) == (12, 3, 4)
    assert_same_training_state(straight, job)
    printed = capsys.readouterr().out
    assert "step 8 epoch 1 loss" in printed and "step 12 epoch 2 loss" in printed

    job, loader, _ = make_run()
    again = fit(job, loader, epochs=3, checkpoint_dir=tmp_path, progress=False)
    assert (again.steps, again.epochs, again.steps_run) == (12, 3, 0)
    # a finished run, resumed, trains nothing and says so in one line (issue 36: the README's example run twice)
    said = capsys.readouterr().err
    assert (
        f"resumed from the checkpoint of step 12 in {tmp_path}: the run already reached epoch 3, nothing left "
        f"to train; delete {tmp_path} to start again" in said
    )


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_resumed_unfinished_run_is_not_called_finished(tmp_path, capsys):
    job, loader, _ = make_run()
    fit(job, loader, steps=3, checkpoint_dir=tmp_path, progress=False)
    job, loader, _ = make_run()
    assert fit(job, loader, steps=5, checkpoint_dir=tmp_path, progress=False).steps_run == 2
    said = capsys.readouterr().err
    assert "resumed from the checkpoint of step 3" in said and "nothing left" not in said


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_plain_batches_without_checkpoints():
    job, _, _ = make_run()
    x, y = make_dataset().tensors
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 30, 10)]
    result = fit(job, batches, epochs=2, progress=False)
    assert (result.steps, result.epochs, result.resumed_from) == (6, 2, None)
    # Counting continues from the job's step; a list has no epoch of its own, so its epochs count from 0.
    assert fit(job, batches, steps=7, progress=False).steps_run == 1
    with pytest.raises(ValueError, match="no batch in epochs"):
        fit(make_run()[0], [], steps=3, progress=False)


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ValueError, "exactly one of epochs= or steps="),
        ({"epochs": 1, "steps": 1}, ValueError, "exactly one of epochs= or steps="),
        ({"steps": 0}, ValueError, "steps must be None or an int >= 1, got 0"),
        ({"epochs": 1.5}, ValueError, "epochs must be None or an int >= 1, got 1.5"),
        ({"steps": True}, ValueError, "steps must be None or an int >= 1, got True"),
        ({"steps": 5, "checkpoint_every": 0}, ValueError, "checkpoint_every must be an int >= 1, got 0"),
        ({"steps": 5, "keep": 0}, ValueError, "keep must be an int >= 1, got 0"),
        ({"steps": 5, "log_every": -1}, ValueError, "log_every"),
        ({"steps": 5, "async_checkpoint": True}, ValueError, "needs a checkpoint_dir"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    job, loader, _ = make_run()
    with pytest.raises(error, match=message):
        fit(job, loader, **kwargs)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_bad_job_or_loader_is_refused(tmp_path):
    job, loader, _ = make_run()
    with pytest.raises(TypeError, match="setup"):
        fit(job.module, loader, steps=1)
    with pytest.raises(TypeError, match="lr_scheduler"):
        fit(job, loader, steps=1, lr_scheduler=object())
    with pytest.raises(TypeError, match="loom.data.loader"):
        fit(job, [(torch.zeros(2, 8), torch.zeros(2, 4))], steps=1, checkpoint_dir=tmp_path)


def launch_fit_workers(run, root: Path, *runs: str, compression: str | None = None) -> dict[str, list[dict]]:
    """Run ``fit_resume.py`` on 2 workers (``run``: `run_workers`); its JSON lines by run (``DIR:STEPS``, DIR
    relative to ``root``), each a list in rank order."""
    args = [f"--compression={compression}"] if compression else []
    outputs = run("fit_resume.py", 2, *args, *(f"{root / spec}" for spec in runs), timeout=100)
    results: dict[str, list[dict]] = {}
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                results.setdefault(record["run"], []).append(record)
    assert all([r["rank"] for r in rs] == [0, 1] for rs in results.values()), results.keys()
    return results


def largest_difference(got: dict, ref: dict) -> float:
    """The largest absolute difference between two ranks' printed results (loss and every parameter)."""
    diffs = [abs(got["loss"] - ref["loss"])]
    for name, values in ref["params"].items():
        diffs.append((torch.tensor(got["params"][name]) - torch.tensor(values)).abs().max().item())
    return max(diffs)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_workers_resume_equals_an_uninterrupted_run(tmp_path, workers):
    # First launch: the uninterrupted reference, and a run stopped at step 6. Second launch: fresh processes
    # resume that run and finish it.
    first = launch_fit_workers(workers, tmp_path, "straight:12", "interrupted:6")
    assert [(r["steps"], r["resumed_from"]) for r in first["interrupted:6"]] == [(6, None), (6, None)]
    resumed = launch_fit_workers(workers, tmp_path, "interrupted:12")["interrupted:12"]
    assert [(r["steps"], r["resumed_from"], r["steps_run"]) for r in resumed] == [(12, 6, 6), (12, 6, 6)]
    for got, ref in zip(resumed, first["straight:12"], strict=True):
        assert largest_difference(got, ref) <= 1e-6, f"rank {got['rank']}"
    assert list(list_checkpoints(tmp_path / "interrupted")) == [10, 12]


COMPRESSION = "topk:0.1"


@pytest.fixture(scope="module")
def compressed_runs(tmp_path_factory) -> tuple[Path, dict, dict]:
    """2 workers with top-k compression. First launch: uninterrupted to step 12, and stopped at 6. Second launch,
    fresh processes: resume the stopped run without taking a step (to see the state as restored), the same
    ignoring the per-rank state (a control), then resume it to step 12."""
    root = tmp_path_factory.mktemp("compressed")
    first = launch_fit_workers(run_workers, root, "straight:12", "interrupted:6", compression=COMPRESSION)
    second = launch_fit_workers(
        run_workers,
        root,
        "interrupted:6",
        "interrupted:6:forget-local",
        "interrupted:12",
        compression=COMPRESSION,
    )
    return root, first, second


@pytest.mark.multiprocess
@pytest.mark.timeout(200)  # the first test pays for the module fixture's two launches
def test_two_workers_compressed_resume_restores_each_ranks_error_feedback(compressed_runs):
    root, first, second = compressed_runs
    checkpoint = list_checkpoints(root / "interrupted")[12]  # step 6's was retired by the resumed run
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert {local_state_file(0), local_state_file(1)} <= set(manifest["files"])  # under the checksums
    for rank in (0, 1):
        saved = read_local_state(checkpoint, rank)["compression"]
        assert saved["codec"] == COMPRESSION and saved["buckets"], rank
        assert all(b["residual"].abs().sum() > 0 for b in saved["buckets"].values()), rank
    at_stop = [r["local_sha"] for r in first["interrupted:6"]]
    assert at_stop[0] != at_stop[1]  # each rank kept its own residual
    restored = second["interrupted:6"]
    assert [(r["resumed_from"], r["steps_run"]) for r in restored] == [(6, 0), (6, 0)]
    assert [r["local_sha"] for r in restored] == at_stop  # bitwise, each rank its own
    assert all(r["local_sha"] not in at_stop for r in second["interrupted:6:forget-local"])  # the control


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_two_workers_compressed_resume_equals_an_uninterrupted_run(compressed_runs):
    _, first, second = compressed_runs
    resumed = second["interrupted:12"]
    assert [(r["steps"], r["resumed_from"], r["steps_run"]) for r in resumed] == [(12, 6, 6), (12, 6, 6)]
    for got, ref in zip(resumed, first["straight:12"], strict=True):
        assert largest_difference(got, ref) <= 1e-6, f"rank {got['rank']}"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_local_state_is_restored_at_the_same_world_size_and_dropped_at_another(tmp_path, capsys):
    job, loader, _ = make_run()
    fit(job, loader, steps=4, checkpoint_dir=tmp_path, progress=False)
    checkpoint = tmp_path / "step-00000004"
    assert read_local_state(checkpoint, 0) == {"compression": None}  # DataParallel's, uncompressed

    def resume() -> list:
        job, loader, _ = make_run()
        loaded: list = []
        job.load_local_state_dict = loaded.append
        assert fit(job, loader, steps=4, checkpoint_dir=tmp_path, progress=False).resumed_from == 4
        return loaded

    assert resume() == [{"compression": None}]
    assert "dropped" not in capsys.readouterr().err

    # The same checkpoint as if two processes had written it: rank 0 of a one-process run must not take it.
    step, state = load_checkpoint(tmp_path)
    state["fit"]["world_size"] = 2
    residuals = [pack_state({"residual": torch.full((3,), float(r))}) for r in range(2)]
    save_checkpoint(tmp_path, step, state, local_states=residuals)
    assert resume() == []
    assert "written by 2 processes, this run has 1" in capsys.readouterr().err
    # Local state without tensors (DataParallel without compression) is dropped without a word.
    save_checkpoint(tmp_path, step, state, local_states=[pack_state({"compression": None})] * 2)
    assert resume() == []
    assert "dropped" not in capsys.readouterr().err
