"""Consistent, atomic checkpoints in safetensors + JSON (no pickle), and the RNG state that goes with them.

```python
from loom.checkpoint import capture_rng, load_checkpoint, restore_rng, save_checkpoint

save_checkpoint("ckpt", step, {"job": job.state_dict(), "loader": loader.state_dict(), "rng": capture_rng()})
found = load_checkpoint("ckpt")          # (step, state) of the newest intact checkpoint, or None
```

A checkpoint becomes visible only once all of it is on disk (`loom.checkpoint.store`); loading reads within
stated bounds (`loom.checkpoint.load`) and falls back past anything damaged or crafted (`loom.checkpoint.find`).
State that differs per process is one file per rank in the same checkpoint (`pack_state`, `read_local_state`,
`read_checkpoint_part`). Format, commit protocol and limits: docs/checkpoints.md.
"""

from loom.checkpoint.background import AsyncCheckpoint, save_checkpoint_async
from loom.checkpoint.find import load_checkpoint
from loom.checkpoint.limits import ReadLimits
from loom.checkpoint.load import read_checkpoint, read_checkpoint_part, read_local_state
from loom.checkpoint.rng import capture_rng, restore_rng
from loom.checkpoint.store import (
    CheckpointError,
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    NoValidCheckpointError,
    checkpoint_name,
    list_checkpoints,
    local_state_file,
    save_checkpoint,
)
from loom.checkpoint.tree import pack_state, unpack_state
from loom.checkpoint.upgrade import upgrade_checkpoint

__all__ = [
    "AsyncCheckpoint",
    "CheckpointError",
    "CorruptCheckpointError",
    "CorruptCheckpointWarning",
    "NoValidCheckpointError",
    "ReadLimits",
    "capture_rng",
    "checkpoint_name",
    "list_checkpoints",
    "load_checkpoint",
    "local_state_file",
    "pack_state",
    "read_checkpoint",
    "read_checkpoint_part",
    "read_local_state",
    "restore_rng",
    "save_checkpoint",
    "save_checkpoint_async",
    "unpack_state",
    "upgrade_checkpoint",
]
