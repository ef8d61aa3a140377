"""What a training script trains: its model, optimizer, loss and data, learned by running it up to
``job.loader(...)``.

Every loom script hands over what it trains to ``strategy.setup(model, optimizer, loss_fn)``, then
``job.loader(dataset, global_batch_size, ...)``. So the script runs in this process (``runpy``, as ``python
train.py`` would) while every strategy's ``setup`` is replaced by a recorder whose job's ``loader`` stops the
script (`_PlanningJob`). Nothing is placed, wrapped, split or communicated, so a script that names
``Pipeline(stages=4)`` is planned from one process too. A temporary replacement rather than a hook in each
strategy: the planner must not add a path to the strategies' own code (observing never changes what is
observed); it is undone in ``finally`` whatever the script does.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.errors import ScriptCaptureError

__all__ = ["STRATEGIES", "CapturedScript", "ScriptCaptureError", "capture_script"]

STRATEGIES = (
    "DataParallel", "ShardedDataParallel", "Gossip", "Hybrid", "Pipeline", "TensorParallel", "ParameterServer",
    "LocalSGD", "DiLoCo",
)  # fmt: skip
"""Every strategy class of `loom.parallel` whose ``setup`` returns a job: recorded here, built by `loom.plan.trial`."""


@dataclass
class CapturedScript:
    """What ``strategy.setup(...)`` and ``job.loader(...)`` received, in this process."""

    script: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Any
    strategy: str
    """The class name of the strategy the script itself names (it is planned like every other)."""
    dataset: Any = None
    global_batch_size: int = 0
    loader_options: dict[str, Any] = field(default_factory=dict)


class _Captured(BaseException):
    """Stops the script once ``job.loader`` has been called (a BaseException: a script's ``except Exception``
    around its training loop must not swallow it)."""


class _PlanningJob:
    """The job a recording ``setup`` returns: its ``loader`` records and stops the script; anything else the
    script asks of the job before building its loader is refused by name."""

    def __init__(self, record: CapturedScript) -> None:
        self._record = record

    def loader(self, dataset: Any, global_batch_size: int, *args: Any, **options: Any) -> Any:
        size = global_batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ScriptCaptureError(
                f"{self._record.script}: job.loader(dataset, global_batch_size={global_batch_size!r}): loom plan "
                "needs a positive integer global batch size. HINT: pass global_batch_size=<int>"
            )
        self._record.dataset = dataset
        self._record.global_batch_size = global_batch_size
        self._record.loader_options = dict(options)
        raise _Captured

    def __getattr__(self, name: str) -> Any:
        raise ScriptCaptureError(
            f"{self._record.script} used job.{name} before job.loader(dataset, global_batch_size): loom plan "
            "learns the data from job.loader, so it must come first. HINT: build the loader right after "
            "strategy.setup(...)"
        )


@contextlib.contextmanager
def _recording_setup(script: str, found: list[CapturedScript]) -> Iterator[None]:
    import loom.parallel as strategies  # here: the strategies import torch.distributed and the comm stack

    saved = {name: getattr(strategies, name).setup for name in STRATEGIES}

    def recorder(strategy_name: str) -> Any:
        def setup(self: Any, model: Any, optimizer: Any, loss_fn: Any = None, *args: Any, **kw: Any) -> Any:
            if not isinstance(model, nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
                raise ScriptCaptureError(
                    f"{script}: {strategy_name}.setup(model, optimizer, loss_fn) got {type(model).__name__} and "
                    f"{type(optimizer).__name__}; loom plan needs an nn.Module and a torch.optim.Optimizer"
                )
            found.append(CapturedScript(script, model, optimizer, loss_fn, strategy_name))
            return _PlanningJob(found[-1])

        return setup

    try:
        for name in STRATEGIES:
            getattr(strategies, name).setup = recorder(name)
        yield
    finally:
        for name, original in saved.items():
            getattr(strategies, name).setup = original


def capture_script(script: str | Path, args: tuple[str, ...] = ()) -> CapturedScript:
    """Run ``script`` (with ``args`` as its command line) until its ``job.loader(...)`` call; return what its
    ``strategy.setup(...)`` and ``job.loader(...)`` received. Raises `ScriptCaptureError` (one line) when the
    script does not exist, fails before, ends without building a model, or builds no loader."""
    path = Path(script)
    if not path.is_file():
        raise ScriptCaptureError(f"{script}: no such file. HINT: pass the path of a loom training script")
    found: list[CapturedScript] = []
    argv = sys.argv
    sys.argv = [str(path), *args]
    try:
        with _recording_setup(str(path), found):
            runpy.run_path(str(path), run_name="__main__")
    except _Captured:
        return found[-1]
    except ScriptCaptureError:
        raise
    except SystemExit as stop:
        if not found:
            raise ScriptCaptureError(
                f"{path} exited (status {stop.code}) before strategy.setup(model, optimizer, loss_fn): it built "
                "no model to plan. HINT: check the script's own arguments after its path"
            ) from None
    except Exception as error:  # the user's code failed: say where, in one line
        raise ScriptCaptureError(
            f"{path} raised {type(error).__name__}: {error} before job.loader(...): loom plan runs the script up "
            "to its loader to learn the model. HINT: run it once with python to check it"
        ) from error
    finally:
        sys.argv = argv
        # undo what the script's loom.init() started here (a group of one), so that planning leaves no global
        # state behind; under loom run, where the planner's trials join a real job, nothing
        from loom.topology import current, shutdown

        if current().world_size == 1:
            shutdown()
    if not found:
        raise ScriptCaptureError(
            f"{path} built no model: it never called strategy.setup(model, optimizer, loss_fn). HINT: loom plan "
            "plans a loom training script (loom.init(); job = strategy.setup(...); job.loader(...))"
        )
    raise ScriptCaptureError(
        f"{path} called {found[-1].strategy}.setup(...) but never job.loader(dataset, global_batch_size): loom "
        "plan learns the data and the global batch size from it. HINT: build the loader with job.loader(...)"
    )
