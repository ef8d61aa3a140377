"""`ParameterServerConfig`: the options of `loom.ParameterServer` (`loom.parallel.ps.parameter_server`), each
documented and checked on construction; `ParameterServerMetrics`: what its job records besides the step records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loom.config_docs import document_options
from loom.errors import check_choice, check_int
from loom.observe.metrics import StepMetrics
from loom.train.engine import ShareOptions

__all__ = ["ParameterServerConfig", "ParameterServerMetrics"]


@dataclass(frozen=True)
class ParameterServerConfig(ShareOptions):
    """How workers and servers agree on the parameters (and the step guard's options, `loom.train.guard`: the
    hang watchdog counts each step's pull and push as collectives of the workers, and a non-finite loss or
    gradient is never pushed)."""

    mode: str = "sync"
    """``sync`` (equals one process), ``async`` (apply on arrival, never wait) or ``ssp`` (bounded staleness)."""
    staleness: int = 0
    """``ssp`` only: a worker may run at most this many clocks ahead of the slowest live worker."""
    worker_timeout_s: float = 60.0
    """A worker silent this long is lost: ``ssp`` stops waiting for it, ``sync`` fails the step naming it."""
    connect_timeout_s: float = 60.0
    """How long `setup` waits for the servers to answer."""
    checkpoint_every: int | None = None
    """Servers save their shards after this many updates. None (default): every step in ``sync``, before the
    step's replies go out (write-ahead, `loom.ps.handlers`); by time (``checkpoint_interval_s``) in
    ``async``/``ssp``. 0: not by count."""
    checkpoint_interval_s: float = 1.0
    """Servers also save once the oldest unsaved update is this many seconds old (and at least 20 times as long
    as their last save took: at most ~5% of a server's time goes to saving a large model). In ``async``/``ssp``
    it bounds what a server's death loses to about this many seconds of updates; time, not a count of updates,
    because the cost and the loss then do not depend on how many workers push how fast. With
    ``checkpoint_every=0`` and ``0`` here, servers save only on request and at shutdown (a restarted server then
    goes back to the start or the last save)."""
    namespace: str = "default"
    """Name of the model on the servers (several models can share servers)."""
    addresses: tuple[str, ...] | None = None
    """Server ``HOST:PORT`` list; default ``LOOM_PS_ADDRS`` (set by ``loom run --servers K``)."""
    secret: str | None = field(default=None, repr=False)
    """Job secret (hex); default ``LOOM_JOB_SECRET``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("mode", self.mode, ("sync", "async", "ssp"))
        check_int("staleness", self.staleness, 0)
        if self.staleness and self.mode != "ssp":
            raise ValueError(f"staleness={self.staleness} applies to mode='ssp' only, not {self.mode!r}")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s!r}")
        check_int("checkpoint_every", self.checkpoint_every, 0, optional=True)
        if not 0 <= self.checkpoint_interval_s < float("inf"):
            raise ValueError(
                f"checkpoint_interval_s must be a number of seconds >= 0 (0: off), got {self.checkpoint_interval_s!r}"
            )

    def server_checkpoint_every(self) -> int:
        """``checkpoint_every`` resolved for this mode: 1 in ``sync`` by default, else 0 (by time only)."""
        return (1 if self.mode == "sync" else 0) if self.checkpoint_every is None else self.checkpoint_every


document_options(ParameterServerConfig, ParameterServerConfig)


class ParameterServerMetrics(StepMetrics):
    """Step records, plus the staleness of this worker's updates and the clocks its pulls were granted at."""

    def __init__(self, rank: int, path: str | None = None) -> None:
        super().__init__(rank, path)
        self.staleness: dict[int, int] = {}
        """Histogram: server version at apply minus the version the gradient was computed on -> updates."""
        self.clocks: list[tuple[int, int]] = []
        """Per pull: (this worker's clock, the slowest live worker's clock) when the pull was granted."""
        self.server_restarts: list[dict[str, Any]] = []
        """Per server restart this worker found: ``{"server", "step", "time" (Unix seconds of the restarted
        server's first answer), "seen_version", "resumed_version", "lost_updates"}`` (``lost_updates``: updates
        this worker saw applied that the restarted server no longer has)."""

    def summary(self, skip_first: int = 1) -> dict[str, Any]:
        lost = sum(r["lost_updates"] for r in self.server_restarts)
        return {**super().summary(skip_first), "staleness": dict(sorted(self.staleness.items())),
                "server_restarts": len(self.server_restarts), "lost_updates": lost}  # fmt: skip
