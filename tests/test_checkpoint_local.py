"""Per-rank files in a checkpoint: packed by each rank, committed atomically with the rest, verified on load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loom.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    load_checkpoint,
    local_state_file,
    pack_state,
    read_checkpoint,
    read_local_state,
    save_checkpoint,
    save_checkpoint_async,
    unpack_state,
)

pytestmark = pytest.mark.unit


def rank_state(rank: int) -> dict:
    """What a compression codec keeps per rank: residuals by bucket, a layout string, a spec."""
    return {
        "compression": {
            "codec": "topk:0.1",
            "buckets": {"0": {"layout": "torch.float32:4;4x16", "residual": torch.full((68,), rank + 0.5)}},
        },
        "seen": (rank, None, 1.5),
    }


def assert_rank_state(loaded: dict, rank: int) -> None:
    expected = rank_state(rank)
    bucket, saved = loaded["compression"]["buckets"]["0"], expected["compression"]["buckets"]["0"]
    assert torch.equal(bucket["residual"], saved["residual"]) and bucket["layout"] == saved["layout"]
    assert loaded["seen"] == expected["seen"] and loaded["compression"]["codec"] == "topk:0.1"


@pytest.mark.timeout(30)
def test_pack_state_round_trips_and_snapshots():
    state = rank_state(1)
    packed = pack_state(state)
    state["compression"]["buckets"]["0"]["residual"].add_(1.0)  # a later in-place update: not in the bytes
    assert_rank_state(unpack_state(packed), 1)
    assert unpack_state(pack_state({})) == {}
    with pytest.raises(ValueError, match="not a state made by pack_state"):
        unpack_state(b"\x00" * 3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("use_async", [False, True])
def test_rank_files_are_listed_in_the_manifest_and_read_back(tmp_path, use_async):
    packed = [pack_state(rank_state(r)) for r in range(3)]
    if use_async:
        save_checkpoint_async(tmp_path, 5, {"w": torch.ones(2)}, local_states=packed).wait()
    else:
        save_checkpoint(tmp_path, 5, {"w": torch.ones(2)}, local_states=packed)
    checkpoint = tmp_path / "step-00000005"
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    assert sorted(files) == sorted(["state.json", "tensors.safetensors", *map(local_state_file, range(3))])
    step, state = load_checkpoint(tmp_path)
    assert step == 5 and torch.equal(state["w"], torch.ones(2))  # the shared state is as before
    for rank in range(3):
        assert_rank_state(read_local_state(checkpoint, rank), rank)
    with pytest.raises(CheckpointError, match="per-rank state for 3 rank\\(s\\), none for rank 3"):
        read_local_state(checkpoint, 3)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.timeout(30)
def test_a_damaged_rank_file_makes_the_whole_checkpoint_fall_back(tmp_path):
    for step in (1, 2):
        save_checkpoint(
            tmp_path, step, {"step": step}, local_states=[pack_state(rank_state(r)) for r in (0, 1)]
        )
    damaged = tmp_path / "step-00000002" / local_state_file(1)
    _flip_last_byte(damaged)
    # Every rank falls back together, whichever rank's file is damaged: rank 0 too, though its own is intact.
    with pytest.warns(CorruptCheckpointWarning, match="rank-00001.safetensors.*sha256"):
        assert load_checkpoint(tmp_path)[0] == 1
    with pytest.raises(CorruptCheckpointError, match="rank-00001.safetensors"):
        read_local_state(tmp_path / "step-00000002", 1)
    (tmp_path / "step-00000002" / local_state_file(0)).unlink()
    with pytest.raises(CorruptCheckpointError, match="rank-00000.safetensors.*missing"):
        read_checkpoint(tmp_path / "step-00000002")


@pytest.mark.timeout(30)
def test_a_manifest_listing_ranks_with_a_gap_is_refused(tmp_path):
    save_checkpoint(tmp_path, 1, {}, local_states=[pack_state({}), pack_state({})])
    manifest_path = tmp_path / "step-00000001" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][local_state_file(2)] = manifest["files"].pop(local_state_file(1))
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match="for ranks 0 to n-1"):
        read_checkpoint(tmp_path / "step-00000001")


@pytest.mark.timeout(30)
def test_local_states_that_are_not_packed_bytes_are_refused(tmp_path):
    with pytest.raises(TypeError, match="local_states must be a sequence of bytes.*pack_state"):
        save_checkpoint(tmp_path, 1, {}, local_states=[rank_state(0)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="local_states must be a sequence of bytes"):
        save_checkpoint_async(tmp_path, 1, {}, local_states=b"abc")  # type: ignore[arg-type]
    assert load_checkpoint(tmp_path) is None  # nothing was written
