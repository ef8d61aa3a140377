"""How much reading one checkpoint may cost: the bounds `loom.checkpoint.load` checks before it allocates.

A checkpoint directory is input like any other (a bad disk, a half-copied backup, a hostile user): every size
read from it is checked against these bounds *before* memory is allocated for it, and JSON before it is
parsed, so a crafted checkpoint costs bounded memory and time and ends in `CorruptCheckpointError`.

The defaults admit every checkpoint `loom.fit` writes up to about 1,000 ranks and refuse what a parser would
choke on (their cost: docs/checkpoints.md#limits); `save_checkpoint` refuses a state whose JSON would break
them. Each file is also read within its tighter *read budget* from the manifest (`ReadLimits.budgeted`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from loom.errors import check_int

__all__ = ["BYTES_PER_ENTRY", "DEFAULT_LIMITS", "ReadLimits", "physical_memory"]

BYTES_PER_ENTRY = 64
"""JSON bytes allowed per entry of a file's read budget (its manifest's ``entries``). What loom writes takes
10-20 bytes per JSON value (a tensor's header entry, an RNG word, an optimizer setting); a file's budget is its
values, or its bytes / 64 where long strings make that more, so a genuine file always fits its own budget."""


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the OS does not say): no tensor file can load beyond it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass(frozen=True)
class ReadLimits:
    """Upper bounds on what reading a checkpoint may allocate; exceeding one makes the checkpoint corrupt."""

    max_manifest_bytes: int = 4 << 20
    """Size of ``manifest.json``: about 100 bytes per listed file, so room for ~40,000 rank files."""
    max_state_bytes: int = 8 << 20
    """Size of ``state.json`` (the state's tree without its tensors) and of a packed state's JSON: read whole,
    and its strings kept, so about twice this in memory."""
    max_json_values: int = 100_000
    """JSON values in one document (commas plus opening brackets plus one): about one Python object each, so
    this bounds what a parsed and decoded document costs beyond its text, and the time to decode it."""
    max_json_depth: int = 100
    """How deeply JSON arrays and objects may nest: far below Python's recursion limit, which the parser and
    `unflatten_state` would otherwise hit."""
    max_number_digits: int = 4300
    """Digits in one JSON number. Python refuses to convert longer integers (``sys.int_max_str_digits``
    defaults to 4300) and converting them takes quadratic time; a float never needs more than 17."""
    max_header_bytes: int = 8 << 20
    """A safetensors header's length (about 100 bytes per tensor: room for ~150,000 tensors)."""
    max_tensor_bytes: int | None = field(default_factory=physical_memory)
    """Size of one tensor file (``tensors.safetensors`` or a rank file). The default is this machine's
    physical memory, since every byte of it becomes a tensor in memory; None for no bound."""
    max_pointer_bytes: int = 256
    """Size of the ``latest`` pointer, which holds one checkpoint name."""

    def __post_init__(self) -> None:
        fix = (
            "the defaults fit every checkpoint loom.fit writes up to a few thousand ranks; raise only the bound "
            "a message named."
        )
        for name, value in vars(self).items():
            check_int(f"ReadLimits.{name}", value, optional=name == "max_tensor_bytes", hint=fix)

    def budgeted(self, entries: int) -> ReadLimits:
        """These limits tightened to one file's budget of ``entries`` (from its manifest entry): at most
        ``entries`` JSON values and ``entries * BYTES_PER_ENTRY`` bytes of JSON (``state.json``, a safetensors
        header, a packed state's skeleton), never more than these absolute limits."""
        size = entries * BYTES_PER_ENTRY
        return replace(
            self,
            max_state_bytes=min(self.max_state_bytes, size),
            max_header_bytes=min(self.max_header_bytes, size),
            max_json_values=min(self.max_json_values, entries),
        )


DEFAULT_LIMITS = ReadLimits()
"""The bounds `load_checkpoint`, `read_checkpoint` and `read_local_state` use unless given others."""
