"""ZeRO's prediction: the share of the one-process training state each rank keeps (`zero_share`; the table:
docs/strategies/sharded.md); the counting itself is `loom.observe.memory` (re-exported here).
"""

from __future__ import annotations

from loom.observe.memory import CATEGORIES, live_tensor_bytes, state_bytes

__all__ = ["CATEGORIES", "live_tensor_bytes", "state_bytes", "zero_share"]


def zero_share(stage: int, world_size: int) -> float:
    """The fraction of the one-process training state (16 bytes per parameter: Adam in fp32) that ZeRO
    ``stage`` keeps per rank on ``world_size`` ranks."""
    n = world_size
    shares = {1: (4 + 4 + 8 / n) / 16, 2: (4 + 12 / n) / 16, 3: 1 / n}
    if stage not in shares:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    return shares[stage]
