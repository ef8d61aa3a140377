"""`compression_hook`: run a codec's collectives inside DDP's backward, asynchronously, and count their bytes.

DDP calls the hook per gradient bucket during backward and waits for the returned futures only at its end. The
hook starts each bucket's first collective with ``async_op=True`` and returns at once, so communication overlaps
the rest of backward. A codec's *final* collective (`Collective.final`) gets its decoding chained with
``Future.then``, run on the backend's thread. A two-round codec (PowerSGD: P, then Q) must not start round 2
from a backend thread: collectives started from callbacks would reach the backend in different orders on
different ranks (gloo matches collectives by sequence number), and waiting inside a callback can starve the
backend's threads. So bucket b's next round is started by bucket b+1's hook call, from the backward thread; the
last bucket drains what is left.

Bytes are recorded in `loom.comm.counters()` when a collective starts, so totals compare directly with an
uncompressed run: ``op="sum"`` under ``"native"``, ``op="gather"`` under ``"all_gather"`` (``(N-1) * D`` bytes
each way for a D-byte message).

Parameter numbers (the keys of the codec's state): DDP's parameters in the order the hook first meets them,
which a fresh DDP's first backward makes model order; so a saved codec state applies to the same parameters in
a resumed run with the same model and DDP settings.
"""

# No `from __future__ import annotations` here: DDP inspects the hook's annotations at registration and
# rejects them unless they are the real `dist.GradBucket` and `torch.futures.Future[torch.Tensor]` objects.

from typing import Any

import torch
import torch.distributed as dist

from loom.comm.compression.base import Codec, Collective, Exchange
from loom.comm.compression.factory import make_codec
from loom.comm.counters import counters
from loom.comm.shards import _all_gather

__all__ = ["CompressionHook", "compression_hook"]


class _Flight:
    """One bucket's exchange in progress: the codec's generator and the collective it waits for."""

    def __init__(self, key: int, exchange: Exchange, buffer: torch.Tensor) -> None:
        self.key = key
        self.exchange = exchange
        self.buffer = buffer
        self.future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self.work: Any = None
        self.result = torch.empty(0)
        """The current collective's output, valid once ``work`` is done."""
        self.description = ""


class CompressionHook:
    """A DDP communication hook averaging each bucket with ``hook.codec`` (built by `compression_hook`); its
    `state_dict` is the codec's: the error-feedback residuals and warm starts, to checkpoint with the model."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        # DDP names the hook in its checks and logs by these attributes, which functions have and objects lack.
        self.__name__ = "compression_hook"
        self.__qualname__ = f"compression_hook({codec.spec!r})"
        self._in_flight: list[_Flight] = []
        self.parameters: list[torch.Tensor] = []
        """The parameters met so far, in the order they were first met: ``parameters[i]`` is the codec's i."""
        self._numbers: dict[int, int] = {}  # id(parameter) -> number; `parameters` keeps the ids valid

    def __call__(
        self, state: dist.ProcessGroup | None, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        group = state
        n = dist.get_world_size(group)
        key = bucket.index()
        if key == 0:
            self._in_flight = []  # leftovers of a backward that failed half-way; their futures are abandoned
        buffer = bucket.buffer()
        params = bucket.parameters()  # DDP lays their gradients out in `buffer` in this order, without gaps
        numbers = [self._number(p) for p in params]
        flight = _Flight(key, self.codec.exchange(numbers, buffer, [p.shape for p in params], n), buffer)
        earlier, self._in_flight = self._in_flight, []
        self._run(flight, group, n, first=True)
        for older in earlier:  # their next round, now that this bucket's first message is on its way
            self._advance(older, group, n)
        while bucket.is_last() and self._in_flight:
            pending, self._in_flight = self._in_flight, []
            for older in pending:
                self._advance(older, group, n)
        # Chained rather than returned: an exception set on a Python-made future reaches DDP's C++ side as an
        # uncastable value ("Unable to cast ... to Tensor"); raised inside a callback it becomes a real error.
        return flight.future.then(lambda done: done.value())

    def _number(self, param: torch.Tensor) -> int:
        number = self._numbers.get(id(param))
        if number is None:
            number = self._numbers[id(param)] = len(self.parameters)
            self.parameters.append(param)
        return number

    def state_dict(self) -> dict[str, Any]:
        return self.codec.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state)

    def __repr__(self) -> str:
        return f"compression_hook({self.codec.spec!r})"

    # -- running the codec's schedule ------------------------------------------------------------------------
    def _run(self, flight: _Flight, group: dist.ProcessGroup | None, n: int, first: bool = False) -> None:
        """Resume the codec (from the backward thread) and start the collective it asks for next."""
        try:
            collective = next(flight.exchange) if first else flight.exchange.send(flight.result)
        except StopIteration as stop:
            _complete(flight, stop.value)
            return
        self._start(flight, collective, group, n)
        if not collective.final:
            self._in_flight.append(flight)

    def _advance(self, flight: _Flight, group: dist.ProcessGroup | None, n: int) -> None:
        try:
            flight.work.wait()
        except RuntimeError as error:
            raise RuntimeError(f"rank {dist.get_rank()}: {flight.description} failed: {error}") from error
        self._run(flight, group, n)

    def _start(
        self, flight: _Flight, collective: Collective, group: dist.ProcessGroup | None, n: int
    ) -> None:
        message = collective.tensor.contiguous()
        flight.description = (
            f"{self.codec.spec} {collective.op} of a {tuple(message.shape)} {message.dtype} message "
            f"for bucket {flight.key} over {n} processes"
        )
        try:
            if collective.op == "sum":
                flight.work = dist.all_reduce(message, group=group, async_op=True)
                flight.result = message
                moved = 2 * (n - 1) * message.nbytes // n
                counters().record("native", moved, moved)
            else:
                gathered = torch.empty(n * message.numel(), dtype=message.dtype, device=message.device)
                flight.work = _all_gather(gathered, message, group=group, async_op=True)
                flight.result = gathered.view(n, message.numel())
                moved = (n - 1) * message.nbytes
                counters().record("all_gather", moved, moved)
        except RuntimeError as error:
            raise RuntimeError(f"rank {dist.get_rank()}: {flight.description} failed: {error}") from error
        if collective.final:
            flight.work.get_future().then(lambda done: _finish(flight, done))


def _finish(flight: _Flight, done: torch.futures.Future) -> None:
    """Decode on the backend's thread once the final collective arrived; always settle the bucket's future."""
    # Everything is caught: a future left unsettled would make DDP wait forever at the end of backward.
    try:
        done.value()  # raises if the collective failed
        try:
            flight.exchange.send(flight.result)
        except StopIteration as stop:
            _complete(flight, stop.value)
            return
        raise RuntimeError("the codec asked for another collective after the one it marked final")
    except Exception as error:
        _fail(flight, error)


def _fail(flight: _Flight, error: Exception) -> None:
    failure = RuntimeError(f"rank {dist.get_rank()}: {flight.description} failed: {error!r}")
    flight.future.set_exception(failure)  # type: ignore[arg-type]  # torch annotates the argument as T


def _complete(flight: _Flight, averaged: torch.Tensor) -> None:
    if averaged is not flight.buffer:
        flight.buffer.copy_(averaged)
    flight.future.set_result(flight.buffer)


def compression_hook(codec: Codec | str) -> CompressionHook:
    """A DDP communication hook that averages gradient buckets with ``codec`` (a `Codec` or a spec string).

    ``ddp.register_comm_hook(group_or_None, compression_hook("topk:0.01"))``. Each DDP model needs its own hook
    and codec (the codec keeps per-parameter state); checkpoint ``hook.state_dict()`` with the model.
    """
    if isinstance(codec, str):
        codec = make_codec(codec)
    if not isinstance(codec, Codec):
        raise TypeError(
            f"compression_hook expects a codec or a spec string, got {type(codec).__name__}. "
            "HINT: compression_hook(make_codec('fp16'))."
        )
    return CompressionHook(codec)
