"""A parameter-server worker's part of a `loom.fit` checkpoint, and putting it back.

The job's state is not replicated (each worker has its own clock), so every worker's `state_dict` goes into its
own file of the checkpoint; rank 0's also holds every server's whole model, which replaces whatever the servers
hold on resume. In ``sync`` a resumed run is bitwise the uninterrupted one. A resume needs the same number of
workers and servers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loom.parallel.ps.parameter_server_pieces import set_pieces
from loom.ps.wire import MessageType

if TYPE_CHECKING:
    from loom.parallel.ps.parameter_server import ParameterServerJob

__all__ = ["load_worker_state", "worker_state"]


def worker_state(job: ParameterServerJob) -> dict[str, Any]:
    """This worker's part of a checkpoint (tensors and JSON only): its clock (``step``), the server versions it
    last saw, its module (the servers' current parameters, its own buffers) and its optimizer's param groups
    (the learning rates its pushes carry); on rank 0 also ``servers``, every server's whole state
    (`loom.ps.shard.ModelShard.state`), read with STATE: a consistent snapshot when no worker is inside a step,
    as at `loom.fit`'s checkpoints. Each server's state travels in one frame, within the wire's payload limit."""
    servers = None
    if job.topology.rank == 0:
        replies = job._request(MessageType.STATE, {})
        servers = [{"meta": r.meta["state"], "tensors": dict(r.tensors)} for r in replies]
        for index, server in enumerate(servers):
            job._versions[index] = int(server["meta"]["version"])
            job._held[index] = -1  # the module's values come from the checkpoint: pull the servers' again
            pieces = {k: v for k, v in server["tensors"].items() if k.startswith("piece.")}
            set_pieces(job._params, job.plan, {int(k.split(".")[1]): v for k, v in pieces.items()})
    else:
        job.fetch_parameters()
    return {
        "model": job.module.state_dict(),
        # Never stepped, but its param groups hold the learning rates a scheduler set, which every push sends.
        "optimizer": job.optimizer.state_dict(),
        "step": job.step,
        "server_versions": list(job._versions),
        "servers": servers,
    }


def load_worker_state(job: ParameterServerJob, state: dict[str, Any]) -> None:
    """Restore this worker's part of a checkpoint; the part holding ``servers`` (rank 0's) also puts every
    server back to its saved state (RESTORE), which wins over what they hold (fresh servers, or servers that
    went on past it). The workers then agree that the restore succeeded (a barrier: none pulls before it) and
    pull the restored parameters.

    Collective when there is a process group: every worker calls it, as `loom.fit`'s resume does. Without
    one, no worker may train before every worker's call has returned."""
    failure: Exception | None = None
    try:
        if state.get("servers") is not None:
            _restore_servers(job, state["servers"])
        job.module.load_state_dict(state["model"])
        job.optimizer.load_state_dict(state["optimizer"])
        job.step = int(state["step"])
    except Exception as error:  # reported on every worker below, so none is left waiting
        failure = error
    if job.topology.is_distributed and dist.is_available() and dist.is_initialized():
        failed = torch.tensor([0 if failure is None else job.topology.rank + 1], device=job.topology.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=job.mesh.group("dp"))
        if failure is None and int(failed.item()):
            raise RuntimeError(
                f"rank {job.topology.rank}: worker rank {int(failed.item()) - 1} could not restore its part "
                "of the parameter-server checkpoint (its error says why)"
            )
    if failure is not None:
        raise failure
    job._versions = [0] * len(job.client.links)  # the restore set the versions back on purpose: nothing lost
    job._pull_dense(peek=True)


def _restore_servers(job: ParameterServerJob, servers: list[dict[str, Any]]) -> None:
    if len(servers) != len(job.client.links):
        raise ValueError(
            f"the checkpoint holds the state of {len(servers)} parameter server(s), this job has "
            f"{len(job.client.links)}. HINT: resume with the same number of servers (loom run --servers)."
        )
    # One token for every send of this restore: a resent copy arriving late is not applied again.
    job._request(
        MessageType.RESTORE,
        {"token": os.urandom(16).hex()},
        [dict(s["tensors"]) for s in servers],
        per_server=[{"state": s["meta"]} for s in servers],
    )
