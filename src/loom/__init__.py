"""loom: one training script, any number of processes; a strategy says how the work is divided.

import loom
topo = loom.init()
job = loom.DataParallel().setup(model, optimizer, loss_fn)   # any strategy: a loom.Job
for batch in job.loader(dataset, global_batch_size=256):
    loss = job.train_step(batch)

Every name is imported on first use (``loom.DataParallel`` imports the strategies and torch), so ``import loom``
alone imports no torch, and ``loom.ray`` and ``loom.spark`` (running a job on Ray or Spark) no Ray or Spark.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below, for type checkers; at run time each is imported on first use
    from loom import checkpoint, comm, data, errors
    from loom.job import Job
    from loom.mesh import Mesh
    from loom.observe.trackers import MLflowTracker, TensorBoardTracker, Tracker
    from loom.parallel import (
        DataParallel,
        DataParallelConfig,
        DiLoCo,
        DiLoCoConfig,
        Gossip,
        GossipConfig,
        Hybrid,
        HybridConfig,
        LocalSGD,
        LocalSGDConfig,
        LossCall,
        ParameterServer,
        ParameterServerConfig,
        Pipeline,
        PipelineConfig,
        ShardedDataParallel,
        ShardedDataParallelConfig,
        TensorParallel,
        TensorParallelConfig,
    )
    from loom.topology import Topology, current, init, shutdown
    from loom.train.fit import FitResult, fit

__all__ = [
    "DataParallel",
    "DataParallelConfig",
    "DiLoCo",
    "DiLoCoConfig",
    "FitResult",
    "Gossip",
    "GossipConfig",
    "Hybrid",
    "HybridConfig",
    "Job",
    "LocalSGD",
    "LocalSGDConfig",
    "LossCall",
    "MLflowTracker",
    "Mesh",
    "ParameterServer",
    "ParameterServerConfig",
    "Pipeline",
    "PipelineConfig",
    "ShardedDataParallel",
    "ShardedDataParallelConfig",
    "TensorBoardTracker",
    "TensorParallel",
    "TensorParallelConfig",
    "Topology",
    "Tracker",
    "checkpoint",
    "comm",
    "current",
    "data",
    "errors",
    "fit",
    "init",
    "shutdown",
]
__version__ = "0.1.0"

_LAZY = {
    "DataParallel": "loom.parallel",
    "DataParallelConfig": "loom.parallel",
    "DiLoCo": "loom.parallel",
    "DiLoCoConfig": "loom.parallel",
    "FitResult": "loom.train.fit",
    "Gossip": "loom.parallel",
    "GossipConfig": "loom.parallel",
    "Hybrid": "loom.parallel",
    "HybridConfig": "loom.parallel",
    "Job": "loom.job",
    "LocalSGD": "loom.parallel",
    "LocalSGDConfig": "loom.parallel",
    "LossCall": "loom.parallel",
    "MLflowTracker": "loom.observe.trackers",
    "Mesh": "loom.mesh",
    "ParameterServer": "loom.parallel",
    "ParameterServerConfig": "loom.parallel",
    "Pipeline": "loom.parallel",
    "PipelineConfig": "loom.parallel",
    "ShardedDataParallel": "loom.parallel",
    "ShardedDataParallelConfig": "loom.parallel",
    "TensorBoardTracker": "loom.observe.trackers",
    "TensorParallel": "loom.parallel",
    "TensorParallelConfig": "loom.parallel",
    "Topology": "loom.topology",
    "Tracker": "loom.observe.trackers",
    "checkpoint": "loom.checkpoint:",
    "comm": "loom.comm:",
    "current": "loom.topology",
    "data": "loom.data:",
    "errors": "loom.errors:",
    "fit": "loom.train.fit",
    "init": "loom.topology",
    "shutdown": "loom.topology",
}
"""Every public name, and the module it comes from (a trailing ``:`` marks a subpackage itself)."""
_LAZY_MODULES = ("ray", "spark")


def __getattr__(name: str) -> object:
    """Each public name on first use (PEP 562), so that ``import loom`` alone imports neither torch nor the
    strategies: ``loom run`` (the launcher, which trains nothing) starts in a fraction of the time, and its
    argument errors come at once. ``loom.ray`` and ``loom.spark`` also need the optional Ray or Spark extras."""
    where = _LAZY.get(name)
    if where is None and name in _LAZY_MODULES:
        where = f"loom.{name}:"
    if where is None and not name.startswith("_") and importlib.util.find_spec(f"loom.{name}") is not None:
        where = f"loom.{name}:"  # a subpackage reached as an attribute, as when ``import loom`` imported them
    if where is None:
        raise AttributeError(f"module 'loom' has no attribute {name!r}")
    if where.endswith(":"):
        value: object = importlib.import_module(where[:-1])
    else:
        value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_LAZY_MODULES})
