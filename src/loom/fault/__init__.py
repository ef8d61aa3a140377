"""Fault tolerance beyond checkpoints: hang diagnosis (`loom.fault.watchdog`, `loom.fault.liveness`), replicas
that disagree and non-finite steps (`loom.fault.desync`), healing's membership (`loom.fault.quorum`) and the
learning rate on a resize (`loom.fault.resize`). Restarts are the launcher's (``loom run --max-restarts``),
resuming is `loom.fit`'s.
"""

from loom.errors import HangError
from loom.fault.desync import ReplicaDesyncError, check_replicas_agree
from loom.fault.resize import scale_learning_rate
from loom.fault.watchdog import Watchdog, collective

__all__ = [
    "HangError",
    "ReplicaDesyncError",
    "Watchdog",
    "check_replicas_agree",
    "collective",
    "scale_learning_rate",
]
