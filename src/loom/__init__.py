"""loom: one training script, any number of processes; a strategy says how the work is divided.

import loom
topo = loom.init()
job = loom.DataParallel().setup(model, optimizer, loss_fn)   # any strategy: a loom.Job
for batch in job.loader(dataset, global_batch_size=256):
    loss = job.train_step(batch)

Every name is imported on first use (PEP 562: ``loom.DataParallel`` imports the strategies and torch), so
``import loom`` alone imports no torch, and ``loom.ray`` and ``loom.spark`` (optional extras) no Ray or Spark:
``loom run``, the launcher, which trains nothing, starts in a fraction of the time and reports errors at once.
"""

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
    name: module
    for module, names in {
        "loom.job": "Job",
        "loom.mesh": "Mesh",
        "loom.observe.trackers": "MLflowTracker TensorBoardTracker Tracker",
        "loom.parallel": "DataParallel DataParallelConfig DiLoCo DiLoCoConfig Gossip GossipConfig Hybrid HybridConfig "
        "LocalSGD LocalSGDConfig LossCall ParameterServer ParameterServerConfig Pipeline PipelineConfig "
        "ShardedDataParallel ShardedDataParallelConfig TensorParallel TensorParallelConfig",
        "loom.topology": "Topology current init shutdown",
        "loom.train.fit": "FitResult fit",
    }.items()
    for name in names.split()
}
"""Every public class and function, and the module it comes from; the subpackages (``loom.checkpoint``,
``loom.comm``, ``loom.data``, ``loom.errors``, ``loom.ray``, ``loom.spark``) are found as modules."""


def __getattr__(name: str) -> object:
    """Each public name or subpackage, imported on its first use (see the module's docstring for why)."""
    value: object
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"loom.{name}") is not None:
        value = importlib.import_module(f"loom.{name}")  # a subpackage reached as an attribute
    else:
        raise AttributeError(f"module 'loom' has no attribute {name!r}")
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "ray", "spark"})
