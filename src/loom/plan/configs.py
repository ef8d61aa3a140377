"""The configurations a plan compares on N processes: each a strategy line to paste and its ``loom run`` line.

`candidates` lists, for ``nproc`` workers (parameter servers come on top): `DataParallel` with each all-reduce
algorithm this topology offers (`loom.comm.auto.candidates`) and each codec of `CODECS`; ZeRO stages 1 to 3;
synchronous parameter servers (1 and 2); `LocalSGD` and `DiLoCo` at each of `PERIODS`; every pipeline depth that
divides N and fits the model's chain (the rest a data axis: `Hybrid`), with each schedule and each of
`MICROBATCHES`; `TensorParallel` over all N (predicted for one MLP chain only). `batch_sizes` says which batch
sizes the profile must measure, so that no prediction extrapolates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["CODECS", "MICROBATCHES", "PERIODS", "Configuration", "batch_sizes", "candidates"]

CODECS = ("fp16", "int8", "powersgd:4", "topk:0.01")
PERIODS = (8, 64)
MICROBATCHES = (2, 4)


@dataclass(frozen=True)
class Configuration:
    """One way to run the script: a family, its options, and the processes it takes."""

    family: str
    """``DataParallel``, ``ShardedDataParallel``, ``ParameterServer``, ``LocalSGD``, ``DiLoCo``, ``Pipeline``,
    ``Hybrid`` or ``TensorParallel``."""
    nproc: int
    options: tuple[tuple[str, object], ...] = ()
    """The strategy's keyword arguments, in order (what `strategy` writes)."""
    servers: int = 0
    """Parameter-server processes ``loom run`` starts beside the workers."""
    dp: int = 1
    pp: int = 1
    tp: int = 1
    hosts: int = 1
    """Hosts the ``nproc`` processes are spread over (``nproc / hosts`` each)."""

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    @property
    def strategy(self) -> str:
        """The Python expression to paste, e.g. ``loom.DataParallel(allreduce="shm")``."""
        args = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in self.options)
        return f"loom.{self.family}({args})"

    @property
    def launch(self) -> str:
        """The ``loom run`` arguments, e.g. ``-n 2 --servers 1``."""
        nodes = f" --nnodes {self.hosts}" if self.hosts > 1 else ""
        servers = f" --servers {self.servers}" if self.servers else ""
        return f"-n {self.nproc // self.hosts}{nodes}{servers}"

    @property
    def name(self) -> str:
        return f"{self.strategy} [{self.launch}]"


def _pipelines(nproc: int, chain_length: int, global_batch: int) -> list[Configuration]:
    out = []
    for pp in range(2, nproc + 1):
        if nproc % pp or pp > chain_length:
            continue
        dp = nproc // pp
        for schedule in ("gpipe", "1f1b"):
            for m in MICROBATCHES:
                if math.ceil(global_batch / dp) < m:
                    continue
                shape: tuple = (("stages", pp),) if dp == 1 else (("dp", dp), ("pp", pp))
                opts = (*shape, ("microbatches", m), ("schedule", schedule))
                out.append(Configuration("Pipeline" if dp == 1 else "Hybrid", nproc, opts, dp=dp, pp=pp))
    return out


def candidates(
    nproc: int, algorithms: tuple[str, ...], chain_length: int, global_batch: int
) -> list[Configuration]:
    """Every configuration of the module docstring for ``nproc`` processes (``nproc >= 2``)."""
    n = nproc
    out = [Configuration("DataParallel", n, (("allreduce", a),), dp=n) for a in algorithms]
    out += [Configuration("DataParallel", n, (("compression", c),), dp=n) for c in CODECS]
    out += [Configuration("ShardedDataParallel", n, (("stage", z),), dp=n) for z in (1, 2, 3)]
    out += [Configuration("ParameterServer", n, (("mode", "sync"),), servers=s, dp=n) for s in (1, 2)]
    out += [Configuration("LocalSGD", n, (("sync_every", h),), dp=n) for h in PERIODS]
    out += [Configuration("DiLoCo", n, (("sync_every", h),), dp=n) for h in PERIODS]
    out += _pipelines(n, chain_length, global_batch)
    out.append(Configuration("TensorParallel", n, (("size", n),), dp=1, tp=n))
    return out


def batch_sizes(configs: list[Configuration], global_batch: int) -> list[int]:
    """The batch sizes the profile must measure: each data share (the largest, ``ceil(B / dp)``: the slowest
    replica sets the step) and each pipeline micro-batch (``ceil(share / m)``)."""
    sizes = {global_batch}
    for c in configs:
        share = math.ceil(global_batch / c.dp)
        m = int(c.option("microbatches", 1) or 1)
        sizes.add(max(1, math.ceil(share / m)))
    return sorted(sizes)
