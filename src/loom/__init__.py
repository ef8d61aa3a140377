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
    from loom import checkpoint as checkpoint
    from loom import comm as comm
    from loom import data as data
    from loom import errors as errors
    from loom.job import Job as Job
    from loom.mesh import Mesh as Mesh
    from loom.observe.trackers import MLflowTracker as MLflowTracker
    from loom.observe.trackers import TensorBoardTracker as TensorBoardTracker
    from loom.observe.trackers import Tracker as Tracker
    from loom.parallel import DataParallel as DataParallel
    from loom.parallel import DataParallelConfig as DataParallelConfig
    from loom.parallel import DiLoCo as DiLoCo
    from loom.parallel import DiLoCoConfig as DiLoCoConfig
    from loom.parallel import Gossip as Gossip
    from loom.parallel import GossipConfig as GossipConfig
    from loom.parallel import Hybrid as Hybrid
    from loom.parallel import HybridConfig as HybridConfig
    from loom.parallel import LocalSGD as LocalSGD
    from loom.parallel import LocalSGDConfig as LocalSGDConfig
    from loom.parallel import LossCall as LossCall
    from loom.parallel import ParameterServer as ParameterServer
    from loom.parallel import ParameterServerConfig as ParameterServerConfig
    from loom.parallel import Pipeline as Pipeline
    from loom.parallel import PipelineConfig as PipelineConfig
    from loom.parallel import ShardedDataParallel as ShardedDataParallel
    from loom.parallel import ShardedDataParallelConfig as ShardedDataParallelConfig
    from loom.parallel import TensorParallel as TensorParallel
    from loom.parallel import TensorParallelConfig as TensorParallelConfig
    from loom.topology import Topology as Topology
    from loom.topology import current as current
    from loom.topology import init as init
    from loom.topology import shutdown as shutdown
    from loom.train.fit import FitResult as FitResult
    from loom.train.fit import fit as fit

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
__all__ = sorted([*_LAZY, "checkpoint", "comm", "data", "errors"])


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
