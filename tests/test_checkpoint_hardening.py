"""Crafted checkpoints cost bounded memory and fall back to the previous intact checkpoint, naming the file.

Each case damages the newest checkpoint the way an adversary would: the manifest is rewritten to match the
crafted file (size and sha256), so only the new bounds and confinement stand between it and the loader.
Huge files are sparse (they take no disk), and reading them would still cost their full size in memory.

Run as a script (``python tests/test_checkpoint_hardening.py``) it prints the peak RSS of loading each
oversized case, measured in a fresh process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from loom.checkpoint import (
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    ReadLimits,
    load_checkpoint,
    pack_state,
    read_local_state,
    save_checkpoint,
    unpack_state,
)
from loom.checkpoint.limits import physical_memory

STEP = "step-00000002"
HUGE_TENSOR_FILE = max(64 << 30, 2 * (physical_memory() or 0))  # more than this machine could allocate
ANY = 1 << 40
"""A read budget (``entries``) an adversary who rewrites the manifest too can claim: the absolute limits hold."""


def two_checkpoints(directory: Path, local_states: bool = False) -> Path:
    """Steps 1 and 2 saved intact; returns step 2's directory, the one each case then damages."""
    for step in (1, 2):
        packed = [pack_state({"r": torch.full((4,), float(step))})] if local_states else []
        save_checkpoint(
            directory, step, {"w": torch.full((8,), float(step)), "step": step}, local_states=packed
        )
    return directory / STEP


def forge(
    checkpoint: Path,
    name: str,
    data: bytes | None = None,
    *,
    size: int | None = None,
    entries: int | None = None,
) -> None:
    """Replace ``name`` with ``data`` (or a sparse file of ``size`` bytes) and make the manifest's size and
    sha256 agree (the read budget it lists, ``entries``, is kept unless ``entries`` is given)."""
    path = checkpoint / name
    path.unlink()
    if data is not None:
        path.write_bytes(data)
        entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    else:
        with open(path, "wb") as file:
            file.truncate(size)
        entry = {"size": size, "sha256": "0" * 64}  # hashing a huge file is what the bound prevents
    if name != "manifest.json":
        manifest_path = checkpoint / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        manifest["files"][name].update(entry, **({} if entries is None else {"entries": entries}))
        manifest_path.write_text(json.dumps(manifest))


def safetensors_bytes(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def link_outside(checkpoint: Path, name: str, outside: Path) -> None:
    """Move ``name`` (a file or, for "", the step directory itself) out of the checkpoint directory and leave
    a symbolic link in its place: the content is genuine, only its place is wrong."""
    source = checkpoint / name if name else checkpoint
    target = outside / (name or checkpoint.name)
    os.rename(source, target)
    os.symlink(target, source)


def many_empty_tensors_header(megabytes: int) -> bytes:
    """A valid safetensors file whose header lists ~20,000 zero-size tensors per MB (the issue's 26 MB case:
    each becomes a tensor object, ~1 KB of memory and ~35 us, before the state is found not to match)."""
    entry = b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
    count = (megabytes << 20) // 60
    return safetensors_bytes(b"{" + b",".join(entry % i for i in range(count)) + b"}")


def many_strings_state(megabytes: int) -> bytes:
    """A state.json of ~65,000 twelve-letter strings per MB: ~180 bytes of Python objects each once parsed
    (issue 25's +724 MB at 63 MB, when the absolute bounds were 64 MiB and 4 million values)."""
    count = (megabytes << 20) // 15
    return b'{"step": 2, "state": {"s": [' + b",".join([b'"abcdefghijkl"'] * count) + b"]}}"


def worst_under_the_limits(kind: str) -> bytes:
    """The costliest files loom's own absolute limits admit, for a forged budget (issue 37): a state.json of
    the most small objects (the most memory per byte), of the longest strings (the most bytes), and a tensor
    header of the most empty tensors, each just under `ReadLimits`' defaults."""
    limits = ReadLimits()
    if kind == "objects":
        count = limits.max_json_values // 2 - 10
        return b'{"step": 2, "state": {"s": [' + b",".join([b'{"a":0}'] * count) + b"]}}"
    if kind == "strings":
        count = limits.max_state_bytes // (limits.max_state_bytes // limits.max_json_values + 3) - 10
        text = b'"' + b"a" * (limits.max_state_bytes // limits.max_json_values) + b'"'
        return b'{"step": 2, "state": {"s": [' + b",".join([text] * count) + b"]}}"
    entry = b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}'
    return safetensors_bytes(b"{" + b",".join(entry % i for i in range(limits.max_json_values // 7)) + b"}")


CRAFTED = {
    "deeply nested state.json": (
        lambda c: forge(c, "state.json", b'{"step": 2, "state": {"w": ' + deep(5_000) + b"}}", entries=ANY),
        r"state\.json: JSON nested 5002 levels deep",
    ),
    "200,000 brackets in state.json": (
        lambda c: forge(c, "state.json", b'{"step": 2, "state": {"w": ' + deep(200_000) + b"}}", entries=ANY),
        r"state\.json: about 200004 JSON values, more than the limit of 100000",
    ),
    "deeply nested manifest.json": (
        lambda c: forge(c, "manifest.json", deep(5_000)),
        r"manifest\.json: JSON nested 5000 levels deep",
    ),
    "5,000-digit integer in state.json": (
        lambda c: forge(c, "state.json", b'{"step": 2, "state": {"n": ' + b"7" * 5000 + b"}}", entries=ANY),
        r"state\.json: a number of more than 4300 digits",
    ),
    "5,000-digit step in manifest.json": (
        lambda c: forge(
            c, "manifest.json", b'{"format": "loom-checkpoint", "version": 1, "step": 1' + b"0" * 4999 + b"}"
        ),
        r"manifest\.json: a number of more than 4300 digits",
    ),
    "600 MB state.json": (
        lambda c: forge(c, "state.json", size=600 << 20, entries=ANY),
        r"state\.json: 629145600 bytes, more than the limit of 8388608\. HINT: .*max_state_bytes",
    ),
    "600 MB manifest.json": (
        lambda c: forge(c, "manifest.json", size=600 << 20),
        r"manifest\.json: 629145600 bytes, more than the limit of 4194304",
    ),
    "huge sparse tensors.safetensors, manifest not updated": (
        lambda c: os.truncate(c / "tensors.safetensors", HUGE_TENSOR_FILE),
        rf"tensors\.safetensors: {HUGE_TENSOR_FILE} bytes, the manifest says \d+ \(truncated",
    ),
    "huge sparse tensors.safetensors, manifest updated": (
        lambda c: forge(c, "tensors.safetensors", size=HUGE_TENSOR_FILE),
        rf"tensors\.safetensors: {HUGE_TENSOR_FILE} bytes, more than the limit of \d+\. HINT: .*max_tensor_bytes",
    ),
    "safetensors header length beyond the file": (
        lambda c: forge(c, "tensors.safetensors", safetensors_bytes(b"{}", length=1 << 62)),
        r"tensors\.safetensors: not a readable safetensors file \(the header claims 4611686018427387904 bytes",
    ),
    "safetensors header claiming 64 GB of tensor data": (
        lambda c: forge(
            c,
            "tensors.safetensors",
            safetensors_bytes(
                {"w": {"dtype": "F64", "shape": [1 << 33], "data_offsets": [0, 1 << 36]}}, b"\0" * 64
            ),
        ),
        r"tensors\.safetensors: .*the tensors cover 68719476736 bytes of data, but the file holds 64",
    ),
    "safetensors shape that does not match its offsets": (
        lambda c: forge(
            c,
            "tensors.safetensors",
            safetensors_bytes(
                {"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 32]}}, b"\0" * 32
            ),
        ),
        r"tensors\.safetensors: .*'w': F32 \[1099511627776\] is 4398046511104 bytes but its offsets",
    ),
    "safetensors with an unknown dtype": (
        lambda c: forge(
            c,
            "tensors.safetensors",
            safetensors_bytes({"w": {"dtype": "F128", "shape": [2], "data_offsets": [0, 32]}}, b"\0" * 32),
        ),
        r"tensors\.safetensors: .*unknown dtype 'F128'",
    ),
    "26 MB tensor header under the absolute limit, manifest's budget kept": (
        lambda c: forge(c, "tensors.safetensors", many_empty_tensors_header(26)),
        r"tensors\.safetensors: not a readable safetensors file \(the header claims 26243047 bytes, .* the limit "
        r"is \d+; the read budget of its manifest entry is \d+ entries",
    ),
    "63 MB state.json under the absolute limits, manifest's budget kept": (
        lambda c: forge(c, "state.json", many_strings_state(63)),
        r"state\.json: the manifest lists 6606\d+ bytes, more than its own read budget of \d+ entries allows",
    ),
    "state.json that is a FIFO": (
        lambda c: ((c / "state.json").unlink(), os.mkfifo(c / "state.json")),
        r"state\.json: is not a regular file",
    ),
}


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_checkpoint_falls_back_naming_the_file(tmp_path, case):
    craft, message = CRAFTED[case]
    craft(two_checkpoints(tmp_path))
    with pytest.warns(CorruptCheckpointWarning, match=rf"checkpoint {STEP} is damaged: .*{STEP}/{message}"):
        step, state = load_checkpoint(tmp_path)
    assert step == 1 and state["step"] == 1 and torch.equal(state["w"], torch.full((8,), 1.0))


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name", ["", "manifest.json", "state.json", "tensors.safetensors", "rank-00000.safetensors"]
)
def test_links_out_of_the_checkpoint_directory_are_refused(tmp_path, name):
    outside = tmp_path / "outside"
    outside.mkdir()
    directory = tmp_path / "checkpoints"
    link_outside(two_checkpoints(directory, local_states=True), name, outside)
    where = f"{STEP}/{name}" if name else STEP
    with pytest.warns(
        CorruptCheckpointWarning,
        match=rf"{re.escape(where)}: is a symbolic link \(to {re.escape(str(outside))}",
    ):
        step, state = load_checkpoint(directory)
    assert step == 1 and state["step"] == 1
    if name == "rank-00000.safetensors":  # asked for directly, the per-rank file is refused as well
        with pytest.raises(CorruptCheckpointError, match="is a symbolic link"):
            read_local_state(directory / STEP, 0)


POINTERS = {
    "oversized": (
        lambda p: os.truncate(p, 1 << 30),
        "is unreadable (1073741824 bytes, more than the limit of 256)",
    ),
    "a link": (lambda p: (p.unlink(), os.symlink("/etc/hostname", p)), "is a symbolic link"),
    "a FIFO": (lambda p: (p.unlink(), os.mkfifo(p)), "is not a regular file"),
}


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", list(POINTERS))
def test_unusable_latest_pointer_falls_back_to_the_newest_intact_checkpoint(tmp_path, kind):
    two_checkpoints(tmp_path)
    (tmp_path / "latest").write_text("step-00000001\n")  # pointer says 1; once refused, the newest (2) wins
    craft, message = POINTERS[kind]
    craft(tmp_path / "latest")
    with pytest.warns(CorruptCheckpointWarning, match=rf"latest {re.escape(message)}.*newest intact"):
        step, _ = load_checkpoint(tmp_path)
    assert step == 2


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_limits_are_configurable_and_save_refuses_what_it_could_not_read():
    nested: list = []
    for _ in range(150):
        nested = [nested]
    with pytest.raises(ValueError, match="nested 15[0-9] levels deep, deeper than the limit of 100"):
        save_checkpoint(tempfile.mkdtemp(), 1, {"deep": nested})
    with pytest.raises(ValueError, match="packed state's JSON holds JSON nested"):
        pack_state({"deep": nested})
    packed = pack_state({"w": torch.ones(3), "ints": list(range(50))})
    with pytest.raises(ValueError, match="about 5[0-9] JSON values, more than the limit of 10"):
        unpack_state(packed, ReadLimits(max_json_values=10))
    with pytest.raises(ValueError, match="max_json_depth must be an int >= 1, got 0"):
        ReadLimits(max_json_depth=0)


# -- peak memory ------------------------------------------------------------------------------------------------
OVERSIZED = [
    "26 MB tensor header under the absolute limit, manifest's budget kept",
    "63 MB state.json under the absolute limits, manifest's budget kept",
    "600 MB state.json",
    "600 MB manifest.json",
    "huge sparse tensors.safetensors, manifest updated",
    "safetensors header claiming 64 GB of tensor data",
]


def _peak_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def measure_peaks(root: Path) -> dict[str, dict[str, int]]:
    """Peak RSS (KiB) of loading each oversized case, and of a 60 MB state.json of real brackets (under the
    size limit, so the depth scan reads it), each from a clean high-water mark (``/proc/self/clear_refs``)."""
    cases = {name: CRAFTED[name][0] for name in OVERSIZED}
    cases["60 MB of nesting in state.json"] = lambda c: forge(
        c, "state.json", b'{"step": 2, "state": ' + deep(30 << 20) + b"}", entries=ANY
    )
    cases["oversized latest"] = lambda c: os.truncate(c.parent / "latest", 1 << 30)
    # The manifest's budgets rewritten as well (issue 37): loom's own absolute limits hold alone.
    cases["26 MB tensor header, budget forged too"] = lambda c: forge(
        c, "tensors.safetensors", many_empty_tensors_header(26), entries=ANY
    )
    cases["63 MB state.json, budget forged too"] = lambda c: forge(
        c, "state.json", many_strings_state(63), entries=ANY
    )
    for kind in ("objects", "strings", "header"):
        name = "tensors.safetensors" if kind == "header" else "state.json"
        cases[f"worst {kind} under the limits, budget forged too"] = lambda c, k=kind, n=name: forge(
            c, n, worst_under_the_limits(k), entries=ANY
        )
    peaks = {}
    for index, (name, craft) in enumerate(cases.items()):
        directory = root / str(index)
        craft(two_checkpoints(directory))
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before, started = _peak_kib(), time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CorruptCheckpointWarning)
            assert load_checkpoint(directory)[0] in (1, 2)
        seconds = time.perf_counter() - started  # reported by the script, never asserted on
        peaks[name] = {"rss_before_kib": before, "peak_kib": _peak_kib(), "seconds": round(seconds, 3)}
    return peaks


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_loading_oversized_cases_keeps_memory_bounded(tmp_path):
    out = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=110, check=True
    ).stdout
    peaks = json.loads(out.splitlines()[-1])
    for name, peak in peaks.items():
        grown_mib = (peak["peak_kib"] - peak["rss_before_kib"]) / 1024
        # Refused from fstat or the header's length: nothing read. The worst files under the limits are read,
        # scanned and parsed: issue 37's bound, +64 MiB, whatever the manifest says.
        assert grown_mib < 64, f"{name}: peak grew by {grown_mib:.0f} MiB"


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="loom-peaks-"))
    print(json.dumps(measure_peaks(root)))
