"""Experiment trackers fed by loom.fit: TensorBoard event files and MLflow runs, read back with the libraries' own
readers; a resumed fit continues the same run with every step once; only rank 0 logs, with no added collective."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_workers
from test_fit import Crash, crash_at, make_run

import loom
from loom.train.fit import fit

tensorboard = pytest.importorskip("tensorboard", reason="needs the tensorboard extra")
mlflow = pytest.importorskip("mlflow", reason="needs the mlflow extra")
from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


@pytest.fixture(autouse=True)
def _mlflow_file_store(monkeypatch):
    """MLflow >= 3.7 refuses its plain directory store unless opted in (see loom.observe.trackers)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def mlflow_runs(root: Path) -> list:
    client = MlflowClient(tracking_uri=root.resolve().as_uri())
    experiments = client.search_experiments()
    return client.search_runs([e.experiment_id for e in experiments])


def mlflow_history(root: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    client = MlflowClient(tracking_uri=root.resolve().as_uri())
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def reference_losses(steps: int) -> tuple[list[float], torch.nn.Module]:
    """The losses train_step returns in a plain loop over the same objects, no tracker: what must be logged."""
    job, loader, scheduler = make_run()
    losses = []
    while len(losses) < steps:
        for batch in loader:
            losses.append(job.train_step(batch))
            scheduler.step()
            if len(losses) == steps:
                break
    return losses, job.module


@pytest.mark.unit
def test_fit_logs_the_step_losses_to_tensorboard_and_mlflow(tmp_path):
    ref, ref_module = reference_losses(7)
    job, loader, scheduler = make_run()
    trackers = [
        loom.TensorBoardTracker(tmp_path / "tb"),
        loom.MLflowTracker(tmp_path / "mlruns", experiment="exp", run_name="r1", params={"lr": 0.01}),
    ]
    fit(job, loader, steps=7, lr_scheduler=scheduler, progress=False, trackers=trackers)
    # observing changed nothing: the same parameters as the loop without trackers
    for x, y in zip(job.module.parameters(), ref_module.parameters(), strict=True):
        assert torch.equal(x, y)
    expected = [(i + 1, loss) for i, loss in enumerate(ref)]
    logged = tensorboard_scalars(tmp_path / "tb", "loss")
    assert [s for s, _ in logged] == list(range(1, 8))
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)  # stored as float32
    lrs = tensorboard_scalars(
        tmp_path / "tb", "lr"
    )  # StepLR(step_size=3, gamma=0.5), stepped after each step
    assert [v for _, v in lrs] == pytest.approx([0.01, 0.01, 0.005, 0.005, 0.005, 0.0025, 0.0025])
    assert len(tensorboard_scalars(tmp_path / "tb", "samples_per_s")) == 7

    (run,) = mlflow_runs(tmp_path / "mlruns")
    assert run.info.run_name == "r1" and run.info.status == "FINISHED" and run.data.params == {"lr": "0.01"}
    assert mlflow_history(tmp_path / "mlruns", run.info.run_id, "loss") == expected  # float64: exact
    steps = [s for s, _ in mlflow_history(tmp_path / "mlruns", run.info.run_id, "step_time_s")]
    assert steps == list(range(1, 8))


@pytest.mark.unit
def test_a_resumed_fit_continues_the_same_runs_with_each_step_once(tmp_path):
    ckpt, tb, ml = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "mlruns"
    for total in (5, 10):  # the second call resumes from the first's last checkpoint (step 5)
        job, loader, scheduler = make_run()
        trackers = [loom.TensorBoardTracker(tb), loom.MLflowTracker(ml)]
        result = fit(job, loader, steps=total, checkpoint_dir=ckpt, lr_scheduler=scheduler, progress=False,
                     trackers=trackers)  # fmt: skip
    assert result.resumed_from == 5
    ref, _ = reference_losses(10)
    expected = [(i + 1, loss) for i, loss in enumerate(ref)]
    (run,) = mlflow_runs(ml)  # one run, not one per call
    assert mlflow_history(ml, run.info.run_id, "loss") == expected
    assert run.info.status == "FINISHED"
    logged = tensorboard_scalars(tb, "loss")
    assert [s for s, _ in logged] == list(range(1, 11))
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)


@pytest.mark.unit
def test_steps_logged_after_the_checkpoint_before_a_crash_appear_once_after_resuming(tmp_path):
    ckpt, tb, ml = tmp_path / "ckpt", tmp_path / "tb", tmp_path / "mlruns"
    job, loader, scheduler = make_run()
    crash_at(job, 6)  # checkpoints at 3; steps 4 and 5 are logged, then the run dies
    with pytest.raises(Crash):
        fit(job, loader, steps=8, checkpoint_dir=ckpt, checkpoint_every=3, lr_scheduler=scheduler,
            progress=False, trackers=[loom.TensorBoardTracker(tb), loom.MLflowTracker(ml)])  # fmt: skip
    (run,) = mlflow_runs(ml)
    assert run.info.status == "FAILED"
    assert [s for s, _ in mlflow_history(ml, run.info.run_id, "loss")] == [1, 2, 3, 4, 5]
    assert [s for s, _ in tensorboard_scalars(tb, "loss")] == [1, 2, 3, 4, 5]

    job, loader, scheduler = make_run()
    result = fit(job, loader, steps=8, checkpoint_dir=ckpt, checkpoint_every=3, lr_scheduler=scheduler,
                 progress=False, trackers=[loom.TensorBoardTracker(tb), loom.MLflowTracker(ml)])  # fmt: skip
    assert result.resumed_from == 3
    (run,) = mlflow_runs(ml)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in mlflow_history(ml, run.info.run_id, "loss")] == list(range(1, 9))
    assert [s for s, _ in tensorboard_scalars(tb, "loss")] == list(range(1, 9))  # 4, 5 purged, retaken once
    ref, _ = reference_losses(8)  # resuming is exact, so the kept and the retaken values are the same
    assert [v for _, v in mlflow_history(ml, run.info.run_id, "loss")] == ref


@pytest.mark.unit
def test_a_tracker_from_an_own_loop(tmp_path):
    job, loader, _ = make_run()
    with loom.MLflowTracker(tmp_path / "mlruns") as tracker:
        tracker.open()
        for step, batch in enumerate(loader, start=1):
            tracker.log({"loss": job.train_step(batch)}, step)
    (run,) = mlflow_runs(tmp_path / "mlruns")
    assert [s for s, _ in mlflow_history(tmp_path / "mlruns", run.info.run_id, "loss")] == list(
        range(1, len(loader) + 1)
    )


@pytest.mark.unit
def test_what_is_not_a_tracker_is_refused():
    job, loader, _ = make_run()
    with pytest.raises(TypeError, match=r"trackers\[0\] is a str.*TensorBoardTracker"):
        fit(job, loader, steps=1, trackers=["tb"])


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_two_ranks_only_rank_0_logs_and_trackers_add_no_collective(tmp_path):
    outs = run_workers("trackers_fit.py", 2, str(tmp_path), timeout=140)
    lines = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    for rank, line in enumerate(lines):
        assert line["calls_with"] == line["calls_without"], f"rank {rank}: {line}"
        assert line["calls_with"]["loom.comm"]["ops"], line  # the counters see the step's collectives
    assert lines[0]["imported"] == [True, True] and lines[1]["imported"] == [False, False]
    (run,) = mlflow_runs(tmp_path / "mlruns")
    logged = mlflow_history(tmp_path / "mlruns", run.info.run_id, "loss")
    assert logged == [(i + 1, loss) for i, loss in enumerate(lines[0]["losses"])]
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tb", "loss")] == list(range(1, 7))


@pytest.mark.unit
def test_a_replica_loss_is_logged_under_its_own_name(tmp_path):
    job, loader, _ = make_run()
    job.loss_scope = "replica"  # as Gossip's and asynchronous parameter servers' jobs say
    fit(job, loader, steps=2, progress=False, trackers=[loom.TensorBoardTracker(tmp_path)])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert "replica_loss" in events.Tags()["scalars"] and "loss" not in events.Tags()["scalars"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("module", "tracker", "extra"),
    [
        ("torch.utils.tensorboard", loom.TensorBoardTracker, "tensorboard"),
        ("mlflow.tracking", loom.MLflowTracker, "mlflow"),
    ],
)
def test_a_missing_library_names_the_extra(monkeypatch, tmp_path, module, tracker, extra):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    job, loader, _ = make_run()
    with pytest.raises(ImportError, match=rf"pip install 'loom-train\[{extra}\]'"):
        fit(job, loader, steps=1, progress=False, trackers=[tracker(tmp_path / "t")])
