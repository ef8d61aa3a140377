"""`GossipConfig`: the options of `loom.Gossip` (`loom.parallel.gossip.gossip`), each documented and checked on
construction."""

from __future__ import annotations

from dataclasses import dataclass

from loom.config_docs import document_options
from loom.errors import check_choice, check_int
from loom.train.engine import ShareOptions

__all__ = ["PEERS", "GossipConfig"]

PEERS = ("ring", "exponential", "random")
"""How a worker picks the peer of each exchange (`loom.parallel.gossip.gossip_exchange.PeerChoice`)."""


@dataclass(frozen=True)
class GossipConfig(ShareOptions):
    """How each worker picks its peers and how long it waits for them (and the step guard's options,
    `loom.train.guard`: a replica's non-finite step is judged on its own flag; the hang watchdog counts the
    evaluation all-reduce, the exchanges are bounded by ``deadline_s``)."""

    peers: str = "ring"
    """Peer of each exchange: ``ring`` (right and left neighbours in turn), ``exponential`` (rank + 2^k, k
    cycling) or ``random`` (uniform among the others)."""
    every: int = 1
    """Steps between two exchanges of this worker (each with one peer)."""
    deadline_s: float = 10.0
    """Longest one exchange may hold a worker (connecting and the peer's answer, which comes at the peer's next
    step boundary); past it the exchange is skipped and training goes on. Set it above the slowest step time."""
    retry_after: int = 8
    """Exchanges for which a peer that was unreachable or late is passed over before it is tried again."""
    same_start: bool = True
    """Start every replica from rank 0's parameters (one broadcast at set-up); False keeps each one's own."""
    seed: int = 0
    """Seeds the ``random`` peer choice (with the rank)."""
    namespace: str = "default"
    """Name of this gossip group in the job's store. A rank set up twice under one name is a worker rejoining
    (it copies a neighbour); two groups in one job need two names."""
    setup_timeout_s: float = 300.0
    """How long set-up waits for every worker to publish its address."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("peers", self.peers, PEERS)
        for name in ("every", "retry_after"):
            check_int(name, getattr(self, name))
        for name in ("deadline_s", "setup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not self.namespace or "/" in self.namespace:
            raise ValueError(f"namespace must be a non-empty name without '/', got {self.namespace!r}")


document_options(GossipConfig, GossipConfig)
