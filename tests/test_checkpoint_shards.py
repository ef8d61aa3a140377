"""Each rank writes its own checkpoint shard; rank 0 publishes the manifest once every part is durable.

Multi-process: rank 0's peak memory while a 4-stage Pipeline saves (tests/workers/ckpt_peak.py), and every
rank falling back together when one rank's file of the newest checkpoint is damaged. In one process: a staging
directory whose manifest was never published is invisible (and removed by the next save), and a checkpoint of
format 1 is refused with a message naming `upgrade_checkpoint`, which converts it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_workers
from test_checkpoint_local import assert_rank_state, rank_state

from loom.checkpoint import (
    CheckpointError,
    CorruptCheckpointWarning,
    NoValidCheckpointError,
    ReadLimits,
    load_checkpoint,
    local_state_file,
    pack_state,
    read_checkpoint_part,
    save_checkpoint,
    upgrade_checkpoint,
)
from loom.checkpoint.store import open_staging, write_rank_file

MiB = 1 << 20


def records(outputs: list[str]) -> list[dict]:
    return [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith("{")]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rank0_peak_during_a_pipeline_save_is_at_most_twice_its_own_state(tmp_path, mode):
    # Two Linear(1024, 1024) with Adam per stage: 32 MiB of training state. Before each rank wrote its own
    # file, rank 0 gathered all four stages' packed state and grew by 233 MiB here; now ~1.5 MiB (each rank
    # streams its file from its tensors).
    found = records(run_workers("ckpt_peak.py", 4, str(tmp_path / "ckpt"), "1024", mode, timeout=220))
    assert sorted(r["rank"] for r in found) == [0, 1, 2, 3]
    for r in found:  # every rank's part came back bitwise from its own file
        assert r["resumed_step"] == 1 and r["bitwise"], r
    rank0 = next(r for r in found if r["rank"] == 0)
    budget = 2 * rank0["own_state_bytes"] + 16 * MiB
    assert rank0["grown"] <= budget, (
        f"rank 0's peak grew by {rank0['grown'] / MiB:.0f} MiB during the save, more than twice its own "
        f"state ({rank0['own_state_bytes'] / MiB:.0f} MiB) plus 16 MiB"
    )
    manifest = json.loads((tmp_path / "ckpt" / "step-00000001" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(
        ["state.json", "tensors.safetensors", *map(local_state_file, range(4))]
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_damaged_rank_file_makes_every_rank_fall_back_together(tmp_path):
    run = f"pipeline={tmp_path / 'ckpt'}:6"  # checkpoints at steps 3 and 6 (fit_strategies.py: every 3)
    first = records(run_workers("fit_strategies.py", 2, run, timeout=120))
    assert [(r["steps"], r["resumed_from"]) for r in first] == [(6, None)] * 2
    damaged = tmp_path / "ckpt" / "step-00000006" / local_state_file(1)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    # Rank 0 reads only its own file, which is intact; it falls back with rank 1 all the same.
    second = records(run_workers("fit_strategies.py", 2, run, timeout=120))
    assert [(r["rank"], r["steps"], r["resumed_from"]) for r in second] == [(0, 6, 3), (1, 6, 3)]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_rank_files_without_a_published_manifest_are_invisible_and_removed(tmp_path):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, local_states=[pack_state(rank_state(0))])
    staging = open_staging(tmp_path, 2)  # a job that crashed after its ranks wrote, before the manifest
    for rank in range(3):
        write_rank_file(staging, rank, pack_state(rank_state(rank)))
    assert load_checkpoint(tmp_path)[0] == 1
    assert not (tmp_path / "step-00000002").exists()
    # The next save (a new process would not know the staging directory) removes it.
    from loom.checkpoint import store

    store._staging_in_use.discard(staging)
    save_checkpoint(tmp_path, 2, {"w": torch.zeros(2)}, local_states=[pack_state(rank_state(0))])
    assert not staging.exists() and load_checkpoint(tmp_path)[0] == 2


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_read_checkpoint_part_reads_only_this_ranks_file(tmp_path):
    save_checkpoint(
        tmp_path, 3, {"w": torch.ones(2)}, local_states=[pack_state(rank_state(r)) for r in range(3)]
    )
    checkpoint = tmp_path / "step-00000003"
    (checkpoint / local_state_file(2)).write_bytes(b"damaged")  # another rank's file: not read here
    step, state, own = read_checkpoint_part(checkpoint, 1)
    assert step == 3 and torch.equal(state["w"], torch.ones(2))
    assert_rank_state(own, 1)
    assert read_checkpoint_part(checkpoint, 7)[2] is None  # no file for this rank (a larger world size)


def _as_format_1(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["version"] = 1
    for entry in manifest["files"].values():
        del entry["entries"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_format_1_is_refused_naming_the_upgrade_which_converts_it(tmp_path):
    save_checkpoint(tmp_path, 4, {"w": torch.full((3,), 4.0)}, local_states=[pack_state(rank_state(0))])
    checkpoint = tmp_path / "step-00000004"
    _as_format_1(checkpoint)
    with (
        pytest.warns(CorruptCheckpointWarning, match=r"format version 1 .*upgrade_checkpoint"),
        pytest.raises(NoValidCheckpointError, match="format version 1"),
    ):
        load_checkpoint(tmp_path)
    upgrade_checkpoint(checkpoint)
    step, state = load_checkpoint(tmp_path)
    assert step == 4 and torch.equal(state["w"], torch.full((3,), 4.0))
    assert_rank_state(read_checkpoint_part(checkpoint, 0)[2], 0)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_upgrade_refuses_an_oversized_state_or_a_cut_tensor_file_with_a_checkpoint_error(tmp_path):
    save_checkpoint(tmp_path, 5, {"w": torch.ones(3)}, local_states=[pack_state(rank_state(0))])
    checkpoint = tmp_path / "step-00000005"
    _as_format_1(checkpoint)
    with pytest.raises(CheckpointError, match=r"state\.json: .* more than the limit of 4"):
        upgrade_checkpoint(checkpoint, limits=ReadLimits(max_state_bytes=4))
    tensor_file = next(p for p in checkpoint.iterdir() if p.suffix == ".safetensors")
    tensor_file.write_bytes(b"\x01\x02")  # shorter than the 8-byte header length
    with pytest.raises(CheckpointError, match=tensor_file.name):
        upgrade_checkpoint(checkpoint)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_rank_file_streamed_from_its_tensors_reads_back_like_pack_state(tmp_path):
    import hashlib
    from collections import OrderedDict

    import safetensors.torch

    from loom.checkpoint import unpack_state
    from loom.checkpoint.tree import PackedState

    state = {
        "w": torch.randn(3, 4), "flag": torch.tensor(True), "empty": torch.zeros(0, 5), "scalar": torch.tensor(2.5),
        "ints": torch.arange(6, dtype=torch.int16).reshape(2, 3), "half": torch.randn(4, dtype=torch.bfloat16),
        "rest": (1, 2.5, None, "x"), "module": OrderedDict(c=torch.ones(2, dtype=torch.complex64)),
    }  # fmt: skip
    packed = PackedState(state)
    staging = open_staging(tmp_path, 1)
    entry = write_rank_file(staging, 0, packed)
    data = (staging / local_state_file(0)).read_bytes()
    assert entry["size"] == len(data) == packed.size
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    loaded = unpack_state(data)
    for key in ("w", "flag", "empty", "scalar", "ints", "half"):
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key]), key
    assert loaded["rest"] == state["rest"] and torch.equal(loaded["module"]["c"], state["module"]["c"])
    assert sorted(safetensors.torch.load(data)) == sorted(
        [*state][:6] + ["module/c"]
    )  # a valid safetensors file
