"""`exchange_locally`: run one codec object per simulated rank in a single process, no sockets.

The collectives a codec yields are carried out here with plain tensor arithmetic, in the same lockstep a real
job has (every rank's generator advanced one collective at a time), so the numerics of compression (and the
bytes it would move, with the conventions of `loom.comm.compression.hook`) can be tested and explored without
processes. Because each rank gets its own codec object, each keeps its own residual, as in a real job.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loom.comm.compression.base import Codec, Collective

__all__ = ["exchange_locally"]


def exchange_locally(
    codecs: Sequence[Codec],
    flats: Sequence[torch.Tensor],
    shapes: Sequence[torch.Size] | None = None,
    params: Sequence[int] | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Average ``flats[r]`` (rank r's 1-D gradient) with ``codecs[r]``; return (each rank's result, bytes sent).

    The byte count is per rank and the same for all (every codec here sends equal-size messages): what
    `compression_hook` would record as ``bytes_sent``. ``shapes`` defaults to one 1-D tensor; ``params``, the
    numbers naming the tensors (the keys of the codecs' state, see `Codec.exchange`), to 0, 1, ...
    """
    n = len(codecs)
    if n == 0 or len(flats) != n:
        raise ValueError(f"need one gradient per codec, got {len(codecs)} codecs and {len(flats)} gradients")
    shapes = list(shapes) if shapes is not None else [flats[0].shape]
    params = list(params) if params is not None else list(range(len(shapes)))
    exchanges = [c.exchange(params, f.clone(), shapes, n) for c, f in zip(codecs, flats, strict=True)]
    requests: list[Collective] = [next(e) for e in exchanges]
    sent = 0
    while True:
        first = requests[0]
        if any(r.op != first.op or r.tensor.shape != first.tensor.shape for r in requests):
            raise RuntimeError(
                f"ranks disagree on collective: {[(r.op, tuple(r.tensor.shape)) for r in requests]}"
            )
        stacked = torch.stack([r.tensor for r in requests])
        result = stacked.sum(0) if first.op == "sum" else stacked  # "gather": row r is rank r's message
        nbytes = first.tensor.nbytes
        sent += 2 * (n - 1) * nbytes // n if first.op == "sum" else (n - 1) * nbytes
        results, next_requests = [], []
        for exchange in exchanges:  # each rank gets its own copy of the result
            try:
                next_requests.append(exchange.send(result.clone()))
            except StopIteration as stop:
                results.append(stop.value)
        if len(results) == n:
            return results, sent
        if results:
            raise RuntimeError("some ranks finished their exchange while others asked for another collective")
        if first.final:
            raise RuntimeError("a codec asked for another collective after one it marked final")
        requests = next_requests
