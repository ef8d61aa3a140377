"""loom: one training script, any number of processes; a strategy says how the work is divided.

import loom
topo = loom.init()
job = loom.DataParallel().setup(model, optimizer, loss_fn)   # any strategy: a loom.Job
for batch in job.loader(dataset, global_batch_size=256):
    loss = job.train_step(batch)
"""

from loom import checkpoint, comm, data, errors
from loom.fit import FitResult, fit
from loom.job import Job
from loom.mesh import Mesh
from loom.strategies import (
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
    "Mesh",
    "ParameterServer",
    "ParameterServerConfig",
    "Pipeline",
    "PipelineConfig",
    "TensorParallel",
    "TensorParallelConfig",
    "Topology",
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
