"""Consistent, atomic checkpoints in safetensors + JSON (no pickle), and the RNG state that goes with them.

```python
from loom.checkpoint import capture_rng, load_checkpoint, restore_rng, save_checkpoint

save_checkpoint("ckpt", step, {"job": job.state_dict(), "loader": loader.state_dict(), "rng": capture_rng()})
found = load_checkpoint("ckpt")          # (step, state) of the newest intact checkpoint, or None
```

A checkpoint becomes visible only once all of it is on disk (`loom.checkpoint.store` has the protocol), and
loading one reads within stated bounds (`loom.checkpoint.load`) and falls back past anything damaged or crafted
(`loom.checkpoint.find`); `save_checkpoint_async` takes the snapshot immediately and writes it in the
background. State that differs per process is stored one file per rank in the same checkpoint: written by
each process into the staging directory under `loom.fit` (`loom.train.fit_checkpoint`), or handed to one writer
packed (``local_states=``, `pack_state`); read back with `read_local_state` or `read_checkpoint_part`.
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
