"""Which actor becomes which rank: `rank_layout`, from where Ray placed each worker's actor."""

from __future__ import annotations

from typing import Any

__all__ = ["rank_layout"]


def _gpu_key(gpu: str) -> tuple[int, str]:
    return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)


def rank_layout(wheres: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks for the actors whose `RankHost.where` reports are ``wheres`` (by bundle), in rank order.

    The ranks of one node are consecutive (nodes in the order their first bundle comes), so LOCAL_RANK and
    LOCAL_WORLD_SIZE mean what they mean under `loom run`. With GPUs, Ray shows each actor only its own
    (CUDA_VISIBLE_DEVICES), but ``loom.init()`` picks ``cuda:LOCAL_RANK``: so every rank of a node sees all the
    node's workers' GPUs, in id order, and the local ranks follow that order too -- with one GPU per worker,
    rank ``cuda:LOCAL_RANK`` is the GPU Ray reserved for it (Ray Train shares them the same way)."""
    nodes = list(dict.fromkeys(where["node_id"] for where in wheres))

    def order(bundle: int) -> tuple:
        gpus = sorted(map(str, wheres[bundle].get("gpus") or []), key=_gpu_key)
        return (nodes.index(wheres[bundle]["node_id"]), _gpu_key(gpus[0]) if gpus else (0, ""), bundle)

    layout, ordered = [], sorted(range(len(wheres)), key=order)
    for bundle in ordered:
        node = wheres[bundle]["node_id"]
        same = [b for b in ordered if wheres[b]["node_id"] == node]
        gpus = sorted({str(g) for b in same for g in wheres[b].get("gpus") or []}, key=_gpu_key)
        layout.append({"bundle": bundle, "local_rank": same.index(bundle), "local_size": len(same),
                       "node_index": nodes.index(node), "visible_gpus": ",".join(gpus) or None})  # fmt: skip
    return layout
