"""Strategies: how the work of training is divided among processes, one package per family.

``data/`` (`DataParallel`, its gradient paths, your own loop), ``pipeline/`` and ``tensor/`` (the model-parallel
transforms), ``model/`` (their composition on one mesh: `Hybrid`, the model-parallel job), ``replica/`` (LocalSGD,
DiLoCo), ``gossip/``, ``ps/`` (the parameter-server worker side; the servers are `loom.ps`). Every strategy's job
subclasses the one step engine, `loom.train.engine.Engine`; collectives live in `loom.comm`."""

from loom.parallel.data.data_parallel import DataParallel, DataParallelConfig, DataParallelJob
from loom.parallel.gossip.gossip import Gossip, GossipConfig, GossipJob
from loom.parallel.model.hybrid import Hybrid, HybridConfig
from loom.parallel.model.model_parallel import ModelParallelJob
from loom.parallel.pipeline.pipeline import Pipeline, PipelineConfig
from loom.parallel.ps.parameter_server import ParameterServer, ParameterServerConfig, ParameterServerJob
from loom.parallel.replica.diloco import DiLoCo, DiLoCoConfig
from loom.parallel.replica.local_sgd import LocalSGD, LocalSGDConfig
from loom.parallel.tensor.tensor_parallel import TensorParallel, TensorParallelConfig
from loom.train.batch import LossCall

__all__ = [
    "DataParallel",
    "DataParallelConfig",
    "DataParallelJob",
    "DiLoCo",
    "DiLoCoConfig",
    "Gossip",
    "GossipConfig",
    "GossipJob",
    "Hybrid",
    "HybridConfig",
    "LocalSGD",
    "LocalSGDConfig",
    "LossCall",
    "ModelParallelJob",
    "ParameterServer",
    "ParameterServerConfig",
    "ParameterServerJob",
    "Pipeline",
    "PipelineConfig",
    "TensorParallel",
    "TensorParallelConfig",
]
