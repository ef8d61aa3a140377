"""Experiment trackers: TensorBoard and MLflow, fed by `loom.fit` (or an own loop) from rank 0, once per step.

``loom.fit(job, loader, ..., trackers=[loom.TensorBoardTracker("runs/exp1")])``; usage, resumed runs (each class
says its own rule), extras and limits (MLflow's file-store opt-in): docs/trackers.md. `loom.fit` logs, on the main
process only, the values `step_metrics` lists, which it already holds after each step: no value is reduced for a
tracker, so a tracker adds no collective. Other ranks never import TensorBoard or MLflow; both are imported when
a tracker opens.
"""

from __future__ import annotations

import abc
import time
from pathlib import Path
from typing import Any

__all__ = ["FitTrackers", "MLflowTracker", "TensorBoardTracker", "Tracker", "step_metrics"]


class Tracker(abc.ABC):
    """Where one run's scalars go. Called on one process only (the main one: `loom.fit` sees to it).

    The life of a tracker: `open` once (fresh, or continuing the run a saved `state_dict` names, at a step),
    `log` after each step, `flush` before a checkpoint is written, `close` at the end (``failed`` when the loop
    raised). `state_dict` is small and JSON-able: it goes into `fit`'s checkpoint.
    """

    kind: str = "tracker"
    """A short name saved with the state, so a checkpoint's state reopens a tracker of the same kind only."""

    @abc.abstractmethod
    def open(self, state: dict[str, Any] | None = None, step: int = 0) -> None:
        """Start a run, or continue the one ``state`` (a `state_dict`) names; ``step``: the last step already
        taken (the resumed checkpoint's), whose successors will be logged again."""

    @abc.abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` against the global optimizer step ``step`` (1 for the first)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """What reopens this run (JSON-able); valid once `open` has run."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Make every value logged so far durable."""

    def close(self, failed: bool = False) -> None:
        """Flush and end the run (``failed``: the loop raised; the run may be resumed later)."""
        self.flush()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        self.close(failed=kind is not None)


class TensorBoardTracker(Tracker):
    """Scalars as TensorBoard event files in ``log_dir`` (`torch.utils.tensorboard.SummaryWriter`).

    The run is the directory: a resumed run writes a new event file there with ``purge_step`` set to the first
    step it takes again, so TensorBoard (and its ``EventAccumulator``) drops the older events from that step on.
    """

    kind = "tensorboard"

    def __init__(self, log_dir: str | Path, flush_secs: int = 30) -> None:
        self.log_dir = str(log_dir)
        self.flush_secs = flush_secs
        self._writer: Any = None

    def open(self, state: dict[str, Any] | None = None, step: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                f"TensorBoardTracker needs the tensorboard package ({err}). HINT: pip install 'loom-train[tensorboard]'"
            ) from err
        if state is not None:
            self.log_dir = state["log_dir"]
        purge = step + 1 if state is not None and step > 0 else None  # resumed: drop retaken steps' events
        self._writer = SummaryWriter(log_dir=self.log_dir, flush_secs=self.flush_secs, purge_step=purge)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def state_dict(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir}

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class MLflowTracker(Tracker):
    """Metrics of one MLflow run, through `mlflow.tracking.MlflowClient` (no global active run is touched).

    ``tracking_uri``: a tracking server or database URI, or a directory (MLflow's file store: docs/trackers.md
    says its opt-in). ``experiment``: its name, created when missing. ``run_name``, ``params`` and
    ``tags``: set when the run is created. Values are sent in batches (`log_batch`) every ``flush_secs`` and at
    `flush`, so a remote server sees one request per interval, not one per step. ``run_id``: continue that run
    instead of creating one (a checkpoint's saved id takes precedence). Its metric history cannot be edited, so a
    resumed run skips the steps the run already holds (the first values are kept).
    """

    kind = "mlflow"

    def __init__(
        self,
        tracking_uri: str | Path,
        experiment: str = "loom",
        run_name: str | None = None,
        params: dict[str, Any] | None = None,
        tags: dict[str, str] | None = None,
        run_id: str | None = None,
        flush_secs: float = 5.0,
    ) -> None:
        uri = str(tracking_uri)
        self.tracking_uri = Path(uri).resolve().as_uri() if "://" not in uri and ":" not in uri[2:] else uri
        self.experiment, self.run_name = experiment, run_name
        self.params, self.tags = dict(params or {}), dict(tags or {})
        self.run_id = run_id
        self.flush_secs = flush_secs
        self._client: Any = None
        self._pending: list[Any] = []
        self._flushed = time.monotonic()
        self._logged_up_to = 0

    def open(self, state: dict[str, Any] | None = None, step: int = 0) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise ImportError(
                f"MLflowTracker needs the mlflow package ({err}). HINT: pip install 'loom-train[mlflow]' "
                "(mlflow-skinny suffices)"
            ) from err
        if state is not None:
            self.tracking_uri, self.run_id = state["tracking_uri"], state["run_id"]
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        if self.run_id is not None:
            self._client.update_run(self.run_id, status="RUNNING")
            self._logged_up_to = self._last_logged_step()
            return
        found = self._client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(self.experiment)
        run = self._client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        if self.params:
            from mlflow.entities import Param

            params = [Param(str(k), str(v)) for k, v in self.params.items()]
            self._client.log_batch(self.run_id, params=params)

    def _last_logged_step(self) -> int:
        """The largest step of any metric the run holds (0 when none): a resumed run logs only beyond it."""
        names = self._client.get_run(self.run_id).data.metrics
        steps = [m.step for name in names for m in self._client.get_metric_history(self.run_id, name)]
        return max(steps, default=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step <= self._logged_up_to:
            return  # already in the run from before the resumed checkpoint's successors were retaken
        from mlflow.entities import Metric

        wall_ms = int(time.time() * 1000)
        self._pending.extend(Metric(name, float(value), wall_ms, step) for name, value in metrics.items())
        if time.monotonic() - self._flushed >= self.flush_secs:
            self.flush()

    def state_dict(self) -> dict[str, Any]:
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id}

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if self._client is None or not self._pending:
            return
        batch, self._pending = self._pending, []
        for start in range(0, len(batch), 1000):  # MLflow's limit of metrics per log_batch call
            self._client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def close(self, failed: bool = False) -> None:
        if self._client is None:
            return
        self.flush()
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
        self._client = None


def step_metrics(job: Any, loss: float | None, epoch: int, step: int) -> dict[str, float]:
    """What `loom.fit` logs after step ``step`` (the table: docs/trackers.md): values this process already holds,
    none reduced for logging; the step time and throughput only when ``job.metrics`` holds this step."""
    values: dict[str, float] = {"epoch": float(epoch)}
    if loss is not None:
        values["loss" if job.loss_scope == "global" else "replica_loss"] = float(loss)
    groups = getattr(job.optimizer, "param_groups", None)
    if groups:
        values["lr"] = float(groups[0]["lr"])
    records = job.metrics.records
    if records and records[-1].step == step and records[-1].time_s > 0:
        values["step_time_s"] = records[-1].time_s
        values["samples_per_s"] = records[-1].global_samples / records[-1].time_s
    return values


class FitTrackers:
    """`loom.fit`'s trackers: active on the main process only, a no-op elsewhere (and when there are none)."""

    def __init__(self, trackers: Any, is_main: bool) -> None:
        trackers = [] if trackers is None else list(trackers)
        for i, tracker in enumerate(trackers):
            if not isinstance(tracker, Tracker):
                raise TypeError(
                    f"trackers[{i}] is a {type(tracker).__name__}, not a loom Tracker. "
                    "HINT: pass loom.TensorBoardTracker(log_dir) or loom.MLflowTracker(tracking_uri)."
                )
        self.trackers = trackers if is_main else []

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def open(self, saved: list[dict[str, Any]] | None, step: int) -> None:
        """Open each tracker, continuing the run its saved state (same position, same kind) names."""
        saved = saved or []
        for i, tracker in enumerate(self.trackers):
            state = saved[i] if i < len(saved) and saved[i].get("kind") == tracker.kind else None
            tracker.open(None if state is None else state["state"], step)

    def log(self, job: Any, loss: float | None, epoch: int, step: int) -> None:
        if self.trackers:
            values = step_metrics(job, loss, epoch, step)
            for tracker in self.trackers:
                tracker.log(values, step)

    def states(self) -> list[dict[str, Any]]:
        """The trackers' states for a checkpoint, after flushing what they hold up to it."""
        for tracker in self.trackers:
            tracker.flush()
        return [{"kind": t.kind, "state": t.state_dict()} for t in self.trackers]

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed=failed)
