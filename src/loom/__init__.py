"""loom: one training script, any number of processes; a strategy says how the work is divided.

import loom
topo = loom.init()
job = loom.DataParallel().setup(model, optimizer, loss_fn)   # any strategy: a loom.Job
for batch in job.loader(dataset, global_batch_size=256):
    loss = job.train_step(batch)

``loom.ray`` and ``loom.spark`` (running a job on Ray or Spark) are imported on first use, so ``import loom``
imports neither them nor Ray or Spark.
"""

from loom import checkpoint, comm, data, errors
from loom.fit import FitResult, fit
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
    TensorParallel,
    TensorParallelConfig,
)
from loom.topology import Topology, current, init, shutdown

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

_LAZY_MODULES = ("ray", "spark")


def __getattr__(name: str) -> object:
    """``loom.ray`` and ``loom.spark`` on first use (PEP 562): they need the optional Ray or Spark extras."""
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f"loom.{name}")
    raise AttributeError(f"module 'loom' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_MODULES})
