"""What one gossip exchange sends and how it is merged, and whom each worker asks (`loom.parallel.gossip.gossip`
argues the exchange's symmetry and conservation)."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from loom.comm.peer import PeerNode
from loom.fault.desync import gradients_finite
from loom.topology import Topology

__all__ = ["IdleServer", "ParameterLayout", "PeerChoice", "PeerDirectory", "average_into"]


class PeerChoice:
    """The sequence of peers one worker asks (see `GossipConfig.peers`); its position is checkpointed."""

    def __init__(self, kind: str, rank: int, world_size: int, seed: int = 0) -> None:
        self.kind, self.rank, self.world_size = kind, rank, world_size
        self.count = 0
        """Peers chosen so far."""
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def next(self) -> int:
        k, world = self.count, self.world_size
        self.count += 1
        if self.kind == "ring":
            return (self.rank + (1 if k % 2 == 0 else -1)) % world
        if self.kind == "exponential":
            return (self.rank + 2 ** (k % (world - 1).bit_length())) % world
        other = int(torch.randint(world - 1, (1,), generator=self.generator))
        return other if other < self.rank else other + 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.generator.set_state(state["generator"])


class ParameterLayout:
    """The floating-point parameters of a model packed back to back (each at a multiple of 8 bytes) in one
    uint8 tensor: what an exchange sends. ``fingerprint`` hashes names, dtypes and shapes (peers must match)."""

    def __init__(self, model: nn.Module) -> None:
        self.params: list[torch.Tensor] = []
        self.slots: list[tuple[int, int]] = []
        described, offset = [], 0
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            size = p.numel() * p.element_size()
            self.params.append(p)
            self.slots.append((offset, size))
            described.append(f"{name}|{p.dtype}|{tuple(p.shape)}")
            offset += -(-size // 8) * 8
        self.nbytes = offset
        digest = hashlib.sha256(";".join(described).encode()).digest()
        self.fingerprint = int.from_bytes(digest[:8], "big")

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        offset, size = self.slots[i]
        p = self.params[i]
        return flat[offset : offset + size].view(p.dtype).view(p.shape)

    def pack(self) -> torch.Tensor:
        flat = torch.zeros(self.nbytes, dtype=torch.uint8)  # zeros: padding must not carry stale memory
        for i, p in enumerate(self.params):
            self.view(flat, i).copy_(p.detach())
        return flat

    def finite(self, flat: torch.Tensor) -> bool:
        return gradients_finite([self.view(flat, i) for i in range(len(self.params))])


def average_into(layout: ParameterLayout, theirs: torch.Tensor, sent: torch.Tensor, serving: bool) -> float:
    """Set ``layout``'s parameters to ``(theirs + sent) / 2`` plus their change since ``sent`` was packed (none
    on the serving side, which packed it just now); return the L2 distance between the two sides' values.

    Both sides compute ``theirs + sent`` (commutative) and halve it, so they hold the same bits; the requester
    then adds its change ``p - sent`` (``0 + m == m`` when nothing else touched it)."""
    squares = 0.0
    with torch.no_grad():
        for i, p in enumerate(layout.params):
            a, b = layout.view(sent, i), layout.view(theirs, i)
            squares += float(torch.dist(a, b).double() ** 2)
            if serving:
                torch.add(b, a, out=p).div_(2)
            else:
                p.sub_(a).add_(torch.add(b, a).div_(2))
    return math.sqrt(squares)


class IdleServer:
    """Pumps a `PeerNode` from a thread whenever the training thread is not inside `paused` (between steps,
    in the loader, in a checkpoint's collectives, after the last step), so peers are answered without waiting
    for this worker's next step. `paused` wakes the thread and takes the node over; both never pump at once."""

    def __init__(self, node: PeerNode, rank: int) -> None:
        self.node = node
        self.failure: BaseException | None = None
        """What stopped the thread, handed to the training thread (`check`)."""
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"loom-gossip-serve-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            if not self._idle.wait(0.5):
                continue
            with self._lock:
                if self._stopping or not self._idle.is_set():
                    continue
                try:
                    self.node.pump(0.25)
                except BaseException as error:  # handed to the training thread at its next step
                    self.failure = error
                    return

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The calling thread owns the node (and the parameters) inside the block."""
        self._idle.clear()
        self.node.wake()
        with self._lock:
            try:
                yield
            finally:
                self._idle.set()

    def check(self, rank: int) -> None:
        if self.failure is not None:
            raise RuntimeError(f"rank {rank}: gossip's serving thread failed") from self.failure

    def stop(self) -> None:
        """End the thread; the node is the caller's again (close it under `paused`)."""
        self._stopping = True
        self._idle.set()
        self.node.wake()
        self._thread.join(timeout=5.0)


class PeerDirectory:
    """Where each worker's listener is, kept in the job's store (the c10d store the process group met in):
    published once at set-up, read again for a peer that became unreachable, since a restarted worker listens
    on a new port. A count of set-ups per rank tells a worker that joins a running job from a fresh start."""

    def __init__(self, store: Any, namespace: str, topology: Topology) -> None:
        self.store, self.topology = store, topology
        self.prefix = f"loom/gossip/{namespace}/"
        self.addresses: dict[int, str] = {}

    def count_join(self) -> int:
        """1 the first time this rank sets up under this name, 2 and more when it rejoins."""
        return int(self.store.add(f"{self.prefix}joins/{self.topology.rank}", 1))

    def publish(self, address: str) -> None:
        self.store.set(f"{self.prefix}addr/{self.topology.rank}", address)

    def wait_for_all(self, timeout_s: float) -> None:
        """Wait until every rank has published (set-up only); the error names the ranks missing."""
        keys = [f"{self.prefix}addr/{r}" for r in range(self.topology.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as error:  # torch's DistStoreError, loom's StoreUnreachable
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            raise RuntimeError(
                f"rank {self.topology.rank}: gossip set-up: rank(s) {missing} did not publish their address within "
                f"{timeout_s} s. HINT: every worker must call Gossip(...).setup(); the log of those ranks says "
                "why they did not (raise setup_timeout_s if they are only slow)."
            ) from error

    def address_of(self, peer: int, refresh: bool) -> str | None:
        """``HOST:PORT`` of ``peer``'s listener; ``refresh`` reads it again (a store that is gone leaves the
        last address known)."""
        if refresh or peer not in self.addresses:
            with contextlib.suppress(RuntimeError, OSError, ValueError):
                self.addresses[peer] = bytes(self.store.get(f"{self.prefix}addr/{peer}")).decode()
        return self.addresses.get(peer)
