"""Timing a training step into phases, without adding a collective: what `StepMetrics` records per step.

A strategy calls, in order: `StepObserver.begin_step` as ``train_step`` starts, `lap` at each phase boundary,
`backward_done` after backward, and `end_step` once the step is decided (the phases: `loom.observe.metrics`).
DDP overlaps the gradient all-reduce with backward, so *comm* counts only what is not overlapped: the time inside
the communication hook (the whole all-reduce for loom's synchronous ``ring``/``driver``, only the launch for the
asynchronous native one), plus the tail of backward after the last bucket was launched, plus the wait for the
loss all-reduce.

loom's algorithms have their DDP communication hook wrapped and timed. DDP's built-in all-reduce gets no hook (a
Python hook costs a GIL handoff per bucket): gradient hooks mark where computation ends (`_watch_gradients`), and
a traced run (``LOOM_TRACE_STEPS``) shows the wait as one collective event, since timing every bucket would take
another path than the one traced. What all this costs: ``python -m loom_bench.metrics_overhead``. Each step's
phase times (`last_phases`) feed `loom.observe.straggler_watch`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from loom.comm import counters
from loom.observe.metrics import StepMetrics
from loom.observe.trace import TraceRecorder, trace_from_env

__all__ = ["DATA", "COMPUTE", "COMM", "OPTIMIZER", "FLAGS_AT", "StepObserver", "loss_buffer_size"]

DATA, COMPUTE, COMM, OPTIMIZER = range(4)
_NAMES = ("data", "compute", "comm", "optimizer")


FLAGS_AT = 1
"""Where the per-rank non-finite flags start in the loss buffer (rank r's is at ``FLAGS_AT + r``)."""


def loss_buffer_size(world_size: int) -> int:
    """Values in `StepObserver.loss_buffer`: the loss sum, then a flag per rank."""
    return FLAGS_AT + world_size


def ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each way of a bandwidth-optimal ring all-reduce of ``nbytes`` (``loom.comm.counters``' estimate)."""
    return 2 * (world_size - 1) * nbytes // world_size


class StepObserver:
    """One process's clock for the phases of each step; see the module docstring for the protocol."""

    def __init__(
        self,
        metrics: StepMetrics,
        world_size: int = 1,
        *,
        enabled: bool = True,
        trace: TraceRecorder | None = None,
    ) -> None:
        self.metrics = metrics
        self.world_size = world_size
        self.enabled = enabled
        self.trace = trace
        self._last_end: float | None = None
        self._laps = [0.0, 0.0, 0.0, 0.0]
        self.last_phases: tuple[float, float, float, float] | None = None
        """The data, compute, comm and optimizer seconds of the last step ended (None before, or when off)."""
        self._seq = 0
        self._step = 0
        self._tracing = False
        self._hook_s = 0.0
        self._last_hook_end: float | None = None
        self._estimated = 0
        self._counted = (0, 0)
        self._grad_bytes = 0
        self._buffer: torch.Tensor | None = None
        self._buffer_view: Any = None

    @classmethod
    def for_process(cls, metrics: StepMetrics, world_size: int, *, enabled: bool = True) -> StepObserver:
        """The observer of a worker, with the trace window of ``LOOM_TRACE_STEPS`` (none when it is off)."""
        trace = trace_from_env(metrics.rank) if enabled else None
        return cls(metrics, world_size, enabled=enabled, trace=trace)

    # -- the clock ---------------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start step number ``step``; the time since the previous step ended counts as data."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self._step = step
        self._tracing = self.trace is not None and self.trace.active(step)
        start = self._last_end if self._last_end is not None else now
        self._laps = [now - start, 0.0, 0.0, 0.0]
        self._start = start
        self._mark = now
        if self._tracing and now > start:
            self.trace.phase("data", start, now, step)  # type: ignore[union-attr]
        self._hook_s, self._last_hook_end, self._estimated = 0.0, None, 0
        self._counted = counters().totals()

    def lap(self, phase: int) -> None:
        """Charge the time since the previous lap to ``phase`` (DATA, COMPUTE, COMM or OPTIMIZER)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self._laps[phase] += now - self._mark
        if self._tracing and now - self._mark > 1e-6:
            self.trace.phase(_NAMES[phase], self._mark, now, self._step)  # type: ignore[union-attr]
        self._mark = now

    def backward_done(self) -> None:
        """Charge forward+backward to compute, minus the time backward was blocked on the gradient all-reduce."""
        if not self.enabled:
            return
        now = time.perf_counter()
        blocked = self._hook_s
        if self._last_hook_end is not None:
            blocked += now - self._last_hook_end
        blocked = min(blocked, now - self._mark)
        if self._grad_bytes:  # the built-in all-reduce, unhooked: one ring estimate for all buckets
            self._estimated += ring_bytes(self._grad_bytes, self.world_size)
            if self._tracing and self._last_hook_end is not None:  # its buckets, as one event: the wait
                self._seq += 1
                self.trace.collective(  # type: ignore[union-attr]
                    "all_reduce gradients (DDP's own)", self._seq, self._last_hook_end, now, self._step,
                    self._grad_bytes,
                )  # fmt: skip
        self._laps[COMPUTE] += now - self._mark - blocked
        self._laps[COMM] += blocked
        if self._tracing:
            self.trace.phase("compute", self._mark, now - blocked, self._step)  # type: ignore[union-attr]
            if blocked > 1e-6:
                self.trace.phase("comm", now - blocked, now, self._step)  # type: ignore[union-attr]
        self._mark = now

    # -- collectives -------------------------------------------------------------------------------------------
    def collective(self, name: str, start: float, end: float, nbytes: int = 0, estimate: bool = True) -> None:
        """Note one collective issued by the strategy: its sequence number, bytes (ring estimate), trace."""
        if not self.enabled:
            return
        self._seq += 1
        if estimate:
            self._estimated += ring_bytes(nbytes, self.world_size)
        if self._tracing:
            self.trace.collective(name, self._seq, start, end, self._step, nbytes)  # type: ignore[union-attr]

    def register_comm_hook(self, ddp: Any, hook: Callable | None) -> None:
        """Register ``hook`` (None: the native all-reduce) on ``ddp``, wrapped to time each gradient bucket."""
        if hook is None:
            if self.enabled:  # traced or not: observing never changes the path it observes
                self._watch_gradients(ddp.module)
            return
        # loom's hooks count their own bytes: the timed one estimates none
        ddp.register_comm_hook(ddp.process_group, self._timed(hook) if self.enabled else hook)

    def _watch_gradients(self, module: torch.nn.Module, first: int = 4) -> None:
        """Native all-reduce: keep DDP's built-in (C++) all-reduce (the module docstring). Gradient computation
        ends at the post-accumulate hooks of the model's first ``first`` parameters, whose gradients backward
        computes last (exact for a sequential model); the rest of backward is DDP waiting for its buckets."""
        params = [p for p in module.parameters() if p.requires_grad]
        self._grad_bytes = sum(p.numel() * p.element_size() for p in params)

        def ready(_: torch.Tensor) -> None:
            self._last_hook_end = time.perf_counter()

        for p in params[:first]:
            p.register_post_accumulate_grad_hook(ready)

    def _timed(self, inner: Callable) -> Callable:
        # Unannotated on purpose: DDP rejects string annotations (this module uses postponed evaluation).
        def timed_hook(state, bucket):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            future = inner(state, bucket)
            returned = time.perf_counter()
            self._hook_s += returned - start
            self._last_hook_end = returned
            self._seq += 1
            seq, step = self._seq, self._step
            if not self._tracing or self.trace is None:
                return future
            nbytes = bucket.buffer().numel() * bucket.buffer().element_size()

            def done(fut: torch.futures.Future) -> torch.Tensor:
                self.trace.collective("all_reduce grad bucket", seq, start, time.perf_counter(), step, nbytes)  # type: ignore[union-attr]
                return fut.value()

            return future.then(done)  # completion time, for the trace only (a callback costs a GIL handoff)

        return timed_hook

    # -- the reduced buffer ------------------------------------------------------------------------------------
    def loss_buffer(self, device: torch.device) -> torch.Tensor:
        """``[loss_sum, flags...]`` all zero: slot 0 for the strategy's loss sum, a non-finite flag per rank (the
        strategy sets its own, ``FLAGS_AT + rank``: not an observation but part of the step's decision,
        `loom.fault.desync.NonFiniteGuard`)."""
        if device.type != "cpu":
            return torch.zeros(loss_buffer_size(self.world_size), dtype=torch.float64, device=device)
        # On CPU one buffer is reused, cleared through its numpy view (cheaper than a new tensor each step). Safe
        # because the strategy waits for the all-reduce and reads the result before the next step.
        if self._buffer is None:
            self._buffer = torch.zeros(loss_buffer_size(self.world_size), dtype=torch.float64)
            self._buffer_view = self._buffer.numpy()
        self._buffer_view.fill(0.0)
        return self._buffer

    def end_step(
        self,
        step: int,
        samples: int,
        global_samples: int,
        loss: float,
        skipped: bool = False,
        **fields: Any,
    ) -> None:
        """Record the step (``skipped``: its update was not applied, see `loom.fault.desync.NonFiniteGuard`;
        ``fields``: a strategy's own fields of the record); its phase times become `last_phases`."""
        if not self.enabled:
            return
        self.lap(COMM)  # the tail of the loss all-reduce's wait, and reading the reduced loss
        now = self._last_end = self._mark
        total_sent, total_received = counters().totals()
        sent = total_sent - self._counted[0] + self._estimated
        received = total_received - self._counted[1] + self._estimated
        data, compute, comm, optimizer = self._laps
        self.metrics.record(step, now - self._start, samples, global_samples, loss, data_s=data,
                            compute_s=compute, comm_s=comm, optimizer_s=optimizer, bytes_sent=sent,
                            bytes_received=received, **fields, **({"skipped": True} if skipped else {}))  # fmt: skip
        self.last_phases = (data, compute, comm, optimizer)
        if self.trace is not None and step >= self.trace.last:
            self.trace.flush()
