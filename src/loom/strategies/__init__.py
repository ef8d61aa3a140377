"""Strategies: how the work of training is divided among processes."""

from loom.strategies._batch import LossCall
from loom.strategies.data_parallel import DataParallel, DataParallelConfig, DataParallelJob
from loom.strategies.diloco import DiLoCo, DiLoCoConfig
from loom.strategies.gossip import Gossip, GossipConfig, GossipJob
from loom.strategies.hybrid import Hybrid, HybridConfig
from loom.strategies.local_sgd import LocalSGD, LocalSGDConfig
from loom.strategies.model_parallel import ModelParallelJob
from loom.strategies.parameter_server import ParameterServer, ParameterServerConfig, ParameterServerJob
from loom.strategies.pipeline import Pipeline, PipelineConfig
from loom.strategies.sharded import ShardedDataParallel, ShardedDataParallelConfig, ShardedDataParallelJob
from loom.strategies.tensor_parallel import TensorParallel, TensorParallelConfig

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
    "ShardedDataParallel",
    "ShardedDataParallelConfig",
    "ShardedDataParallelJob",
    "TensorParallel",
    "TensorParallelConfig",
]
