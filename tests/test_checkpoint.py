"""Checkpoints round-trip exactly, survive damage and crashes, and asynchronous saves see only their own step."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from workers.common import make_dataset, make_mlp, make_optimizer

from loom.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    CorruptCheckpointWarning,
    NoValidCheckpointError,
    capture_rng,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    restore_rng,
    save_checkpoint,
    save_checkpoint_async,
)

WORKERS = Path(__file__).parent / "workers"


def assert_identical(saved, loaded, path="state"):
    """Same types (tuple is not list, OrderedDict is not dict), same keys, bitwise-equal tensors, equal floats."""
    assert type(loaded) is type(saved), f"{path}: {type(saved).__name__} came back as {type(loaded).__name__}"
    if isinstance(saved, torch.Tensor):
        assert (saved.dtype, saved.shape) == (loaded.dtype, loaded.shape), path
        assert torch.equal(saved.reshape(-1).view(torch.uint8), loaded.reshape(-1).view(torch.uint8)), path
    elif isinstance(saved, dict):
        assert list(saved) == list(loaded), f"{path}: keys {list(saved)} vs {list(loaded)}"
        for k in saved:
            assert_identical(saved[k], loaded[k], f"{path}/{k!r}")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(loaded), path
        for i, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            assert_identical(a, b, f"{path}/{i}")
    elif isinstance(saved, float):
        assert math.copysign(1, saved) == math.copysign(1, loaded), path
        assert saved == loaded or (math.isnan(saved) and math.isnan(loaded)), path
    else:
        assert saved == loaded, path


def trained(optimizer: str, steps: int = 3):
    x, y = make_dataset().tensors
    model = make_mlp()
    opt = make_optimizer(optimizer, model)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_model_adam_and_sgd_round_trip_exactly(tmp_path):
    model, adam = trained("adam")
    _, sgd = trained("sgd")
    adam.param_groups[0]["betas"] = (0.85, 0.995)
    state = {"model": model.state_dict(), "adam": adam.state_dict(), "sgd": sgd.state_dict(), "step": 3}
    save_checkpoint(tmp_path, 3, state)
    step, loaded = load_checkpoint(tmp_path)
    assert step == 3
    assert_identical(state, loaded)
    assert loaded["model"]._metadata == model.state_dict()._metadata
    assert loaded["adam"]["param_groups"][0]["betas"] == (0.85, 0.995)
    assert sorted(loaded["adam"]["state"]) == [0, 1, 2, 3]

    # Restored into fresh objects, training continues bit for bit like the original.
    other = make_mlp()
    other_adam = make_optimizer("adam", other)
    other.load_state_dict(loaded["model"])
    other_adam.load_state_dict(loaded["adam"])
    x, y = make_dataset().tensors
    for m, opt in ((model, adam), (other, other_adam)):
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_awkward_values_round_trip(tmp_path):
    base = torch.arange(12, dtype=torch.float64).view(3, 4)
    state = {
        "floats": [0.1, -0.0, float("nan"), float("inf"), -float("inf"), 1e-310, 2.0],
        "ints": [0, -1, 2**70, True, False, None],
        "keys": {0: "int", "0": "str", (1, "a"): "tuple", 2.5: "float", None: "none", True: "bool"},
        "tag": {"__loom__": "not a tag", "nested": ({"a": [()]}, [])},
        "ordered": OrderedDict(b=1, a=2),
        "tensors": {
            "view": base.t(),  # non-contiguous
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "bf16": torch.randn(5).bfloat16(),
            "mask": torch.tensor([True, False]),
            "bytes": torch.tensor([0, 255], dtype=torch.uint8),
        },
        "same": [base, base],
        "text": "ünïcode / slashes",
        "numpy": {"f": np.float64(0.5), "i": np.int64(3)},
    }
    save_checkpoint(tmp_path, 0, state)
    _, loaded = load_checkpoint(tmp_path)
    expected = dict(state, numpy={"f": 0.5, "i": 3})
    expected["tensors"] = dict(state["tensors"], view=base.t().contiguous())
    assert_identical(expected, loaded)
    assert type(loaded["numpy"]["i"]) is int


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_unsupported_value_is_refused_with_its_path(tmp_path):
    with pytest.raises(TypeError, match=r"'extra/fn'.*function"):
        save_checkpoint(tmp_path, 1, {"extra": {"fn": len}})
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save_checkpoint(tmp_path, -1, {})
    with pytest.raises(ValueError, match="keep must be"):
        save_checkpoint(tmp_path, 1, {}, keep=0)
    assert not list(tmp_path.iterdir())


def _rewrite_json_keeping_manifest(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace a file with ``data`` and update the manifest's size and sha256 (its read budget is kept), so
    only the content itself is wrong."""
    import hashlib

    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _truncate(ckpt: Path) -> None:
    data = (ckpt / "tensors.safetensors").read_bytes()
    (ckpt / "tensors.safetensors").write_bytes(data[: len(data) // 2])


def _flip_byte(ckpt: Path) -> None:
    data = bytearray((ckpt / "tensors.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (ckpt / "tensors.safetensors").write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated": (_truncate, r"tensors\.safetensors.*truncated"),
    "bad checksum": (_flip_byte, r"tensors\.safetensors.*sha256"),
    "missing file": (lambda c: (c / "state.json").unlink(), r"state\.json.*missing"),
    "malformed manifest": (
        lambda c: (c / "manifest.json").write_text('{"format": "loom-ch'),
        r"manifest\.json.*JSON",
    ),
    "malformed state": (
        lambda c: _rewrite_json_keeping_manifest(c, "state.json", b'{"step": 3, "state": {'),
        r"state\.json.*JSON",
    ),
    "dangling tensor": (
        lambda c: _rewrite_json_keeping_manifest(c, "state.json", b'{"step": 3, "state": {"w": 1}}'),
        r"state\.json.*never refers",
    ),
    "missing directory": (lambda c: os.rename(c, c.parent / "elsewhere"), r"latest names step-00000003"),
}


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_damaged_latest_falls_back_to_the_previous_checkpoint(tmp_path, kind):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"w": torch.full((64,), float(step)), "step": step})
    damage, message = CORRUPTIONS[kind]
    damage(tmp_path / "step-00000003")
    with pytest.warns(CorruptCheckpointWarning, match=message):
        step, state = load_checkpoint(tmp_path)
    assert step == 2 and state["step"] == 2 and torch.equal(state["w"], torch.full((64,), 2.0))


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_bad_pointer_and_no_intact_checkpoint(tmp_path):
    assert load_checkpoint(tmp_path / "absent") is None
    assert load_checkpoint(tmp_path) is None
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"w": torch.ones(3)})
    (tmp_path / "latest").write_text("garbage\n")
    with pytest.warns(CorruptCheckpointWarning, match="not a checkpoint name"):
        assert load_checkpoint(tmp_path)[0] == 2
    for step in (1, 2):
        _truncate(tmp_path / f"step-{step:08d}")
    with pytest.warns(CorruptCheckpointWarning), pytest.raises(NoValidCheckpointError, match="step-00000001"):
        load_checkpoint(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="tensors.safetensors"):
        read_checkpoint(tmp_path / "step-00000002")


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_keep_retains_the_newest_and_pointer_is_authoritative(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004", "step-00000005"]
    assert (tmp_path / "latest").read_text() == "step-00000005\n"
    for step in range(6, 9):
        save_checkpoint(tmp_path, step, {"step": step}, keep=None)
    assert list(list_checkpoints(tmp_path)) == [4, 5, 6, 7, 8]

    # A run that crashed after writing step 8 but before moving the pointer: latest still says 7, and the
    # resumed run's own step 8 replaces the orphan, as its step 9 would remove it.
    (tmp_path / "latest").write_text("step-00000007\n")
    assert load_checkpoint(tmp_path)[1] == {"step": 7}
    save_checkpoint(tmp_path, 8, {"step": 8, "rerun": True}, keep=3)
    assert list(list_checkpoints(tmp_path)) == [6, 7, 8]
    assert load_checkpoint(tmp_path)[1] == {"step": 8, "rerun": True}
    (tmp_path / "latest").write_text("step-00000006\n")
    save_checkpoint(tmp_path, 7, {"step": 7, "rerun": True}, keep=3)
    assert list(list_checkpoints(tmp_path)) == [6, 7]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_async_save_captures_values_at_the_call(tmp_path):
    weights = torch.zeros(2_000_000)  # 8 MB: the write outlasts the mutations below
    config = {"lr": [0.1]}
    first = save_checkpoint_async(tmp_path, 1, {"w": weights, "config": config})
    weights.add_(1.0)
    config["lr"][0] = 99.0
    second = save_checkpoint_async(tmp_path, 2, {"w": weights, "config": config})  # waits for the first
    assert first.done()
    weights.add_(1.0)
    assert second.wait() == tmp_path / "step-00000002"
    assert torch.equal(read_checkpoint(first.wait())[1]["w"], torch.zeros(2_000_000))
    assert read_checkpoint(first.wait())[1]["config"] == {"lr": [0.1]}
    step, state = load_checkpoint(tmp_path)
    assert step == 2 and torch.equal(state["w"], torch.ones(2_000_000)) and state["config"]["lr"] == [99.0]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_async_failure_is_raised_by_wait_and_by_the_next_save(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    handle = save_checkpoint_async(blocker, 1, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="step 1"):
        handle.wait()
    handle = save_checkpoint_async(blocker, 2, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="step 2"):
        save_checkpoint_async(tmp_path / "ok", 3, {"w": torch.ones(2)})
    save_checkpoint_async(tmp_path / "ok", 4, {}).wait()  # the failure is reported once, then cleared


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_rng_capture_and_restore_through_a_checkpoint(tmp_path):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    torch.randn(3), random.random(), np.random.rand(), random.gauss(0, 1), np.random.randn()
    save_checkpoint(tmp_path, 1, {"rng": capture_rng()})
    expected = (torch.randn(4), [random.random() for _ in range(3)], random.gauss(0, 1), np.random.randn(4))
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    restore_rng(load_checkpoint(tmp_path)[1]["rng"])
    got = (torch.randn(4), [random.random() for _ in range(3)], random.gauss(0, 1), np.random.randn(4))
    assert torch.equal(expected[0], got[0]) and expected[1:3] == got[1:3]
    assert np.array_equal(expected[3], got[3])


def _check_directory(directory: Path) -> int | None:
    """Every visible checkpoint is intact, `latest` names one, and loading picks it without a warning."""
    for step, path in list_checkpoints(directory).items():
        found_step, state = read_checkpoint(path)
        assert found_step == step == state["extra"]["step"]
        assert torch.equal(state["weights"], torch.full((128, 1024), float(step)))
    pointer = directory / "latest"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = load_checkpoint(directory)
    if not pointer.exists():
        return None if found is None else found[0]
    name = pointer.read_text()
    assert name.endswith("\n") and (directory / name.strip()).is_dir(), f"latest holds {name!r}"
    assert found is not None and f"step-{found[0]:08d}" == name.strip()
    return found[0]


def _wait_for_a_new_checkpoint(directory: Path, before: str | None, limit_s: float = 60.0) -> None:
    """Return once ``latest`` names another checkpoint than ``before``: the writer published one more."""
    pointer, deadline = directory / "latest", time.monotonic() + limit_s
    while not (pointer.exists() and pointer.read_text() != before):
        assert time.monotonic() < deadline, f"the writer published nothing within {limit_s} s"
        time.sleep(0.002)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigkill_at_random_moments_never_exposes_a_partial_checkpoint(tmp_path):
    """25 writers, each killed at a random moment after it published one checkpoint: the kills follow the
    writer's progress, not the clock, so every round adds a step however loaded the machine is."""
    directory = tmp_path / "ckpt"
    rng = random.Random(1234)
    errors = open(tmp_path / "zygote.err", "w+")  # noqa: SIM115 - closed in finally
    zygote = subprocess.Popen(
        [sys.executable, str(WORKERS / "ckpt_crash.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )

    def read_int() -> int:
        line = zygote.stdout.readline()
        errors.seek(0)
        assert line, f"the zygote died:\n{errors.read()[-3000:]}"
        return int(line)

    steps, mid_write = [], 0
    try:
        for _ in range(25):
            before = (directory / "latest").read_text() if (directory / "latest").exists() else None
            zygote.stdin.write(f"{directory}\n")
            zygote.stdin.flush()
            pid = read_int()
            _wait_for_a_new_checkpoint(directory, before)
            time.sleep(rng.uniform(0.0, 0.05))  # then anywhere in the next write(s)
            os.kill(pid, signal.SIGKILL)
            status = read_int()
            errors.seek(0)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, errors.read()[-3000:]
            # Leftovers of the killed writer: .tmp-* / .trash-* directories or a .latest.tmp-* file.
            mid_write += directory.exists() and any(p.name.startswith(".") for p in directory.iterdir())
            steps.append(_check_directory(directory))
    finally:
        os.killpg(zygote.pid, signal.SIGKILL)
        zygote.wait()
        errors.close()
    known = [s for s in steps if s is not None]
    assert known == sorted(known), f"a restarted writer went backwards: {steps}"
    assert known and known[-1] >= 25, f"each of the 25 writers published at least one: {steps}"
    assert mid_write >= 1, "no kill landed inside a write; lengthen the writes"
