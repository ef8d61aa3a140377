"""Fault tolerance beyond checkpoints: hang diagnosis, replica desync detection, resizing on resume.

- `loom.fault.watchdog`: numbered collectives and a thread that stops a stuck job with a report naming the ranks
  that did not arrive;
- `loom.fault.desync`: `check_replicas_agree`, a cheap exact check that data-parallel replicas agree;
- `loom.fault.resize`: the linear learning-rate scaling rule applied when a job resumes at another world size.

Restarts themselves are the launcher's (``loom run --max-restarts``) and resuming is `loom.fit`'s.
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
