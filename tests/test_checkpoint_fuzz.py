"""Fuzzing the checkpoint parsers: whatever the bytes, the only error is the one loading falls back on.

`load_checkpoint` skips a damaged checkpoint only when reading it raises `CorruptCheckpointError`; any other
exception (`RecursionError`, `AttributeError`, an int-conversion `ValueError`...) would end the run instead of
falling back. These properties feed the manifest parser, the state parser and `unpack_state` arbitrary bytes,
arbitrary JSON, and valid documents with one part replaced, and allow only that error.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom.checkpoint import CorruptCheckpointError, pack_state, unpack_state
from loom.checkpoint.load import parse_manifest, parse_state

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=150, deadline=2000, database=None, suppress_health_check=[HealthCheck.too_slow])
WHERE = Path("/ckpt/step-00000002")
TENSORS = {"w": torch.ones(2), "b/0": torch.zeros(3, dtype=torch.int64)}
MANIFEST = {
    "format": "loom-checkpoint",
    "version": 1,
    "step": 2,
    "created_unix": 1.5,
    "files": {
        "state.json": {"size": 10, "sha256": "ab" * 32},
        "tensors.safetensors": {"size": 72, "sha256": "cd" * 32},
        "rank-00000.safetensors": {"size": 1, "sha256": "ef" * 32},
    },
}
STATE = {
    "step": 2,
    "state": {
        "w": {"__loom__": "tensor", "key": "w", "dtype": "torch.float32", "shape": [2]},
        "b": [{"__loom__": "tensor", "key": "b/0", "dtype": "torch.int64", "shape": [3]}],
        "t": {"__loom__": "tuple", "items": [1, 2.5]},
        "k": {"__loom__": "odict", "items": [[0, "a"]], "metadata": {"": {"version": 1}}},
        "nan": {"__loom__": "float", "value": "nan"},
    },
}

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
tags = st.sampled_from(["tuple", "dict", "odict", "float", "tensor", "other"])
keys = st.sampled_from(
    ["__loom__", "items", "key", "dtype", "shape", "value", "metadata", "w", "b/0"]
) | st.text(max_size=6)
json_values = st.recursive(
    scalars | tags,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=25,
)


def paths(document: Any, prefix: tuple = ()) -> list[tuple]:
    """Every position in a JSON document, as the keys and indices that reach it."""
    found = [prefix]
    items = (
        document.items()
        if isinstance(document, dict)
        else enumerate(document)
        if isinstance(document, list)
        else []
    )
    for key, value in items:
        found += paths(value, (*prefix, key))
    return found


def replaced(document: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    document = copy.deepcopy(document)
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return document


def documents(valid: dict) -> st.SearchStrategy[bytes]:
    """Bytes near ``valid``: one part replaced, JSON of any shape, deep nesting, or arbitrary bytes."""
    mutated = st.tuples(st.sampled_from(paths(valid)), json_values).map(lambda pv: replaced(valid, *pv))
    return st.one_of(
        mutated.map(lambda d: json.dumps(d).encode()),
        json_values.map(lambda d: json.dumps(d).encode()),
        st.integers(0, 3000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(4290, 4310).map(lambda n: b'{"step": 2, "state": ' + b"9" * n + b"}"),
        st.binary(max_size=200),
    )


@pytest.mark.timeout(60)
@FUZZ
@given(documents(MANIFEST))
def test_manifest_parser_raises_only_corrupt_checkpoint_error(data):
    try:
        manifest = parse_manifest(data, WHERE / "manifest.json")
    except CorruptCheckpointError as err:
        assert str(err).startswith(f"{WHERE}/manifest.json: ")
    else:
        assert set(manifest["files"]) >= {"state.json", "tensors.safetensors"}


@pytest.mark.timeout(60)
@FUZZ
@given(documents(STATE))
def test_state_parser_raises_only_corrupt_checkpoint_error(data):
    try:
        state = parse_state(data, dict(TENSORS), 2, WHERE / "state.json")
    except CorruptCheckpointError as err:
        assert str(err).startswith(f"{WHERE}/state.json: ")
    else:
        assert isinstance(state, dict)


PACKED = pack_state({"w": torch.arange(4.0), "seen": (1, None, [2.5])})


@pytest.mark.timeout(60)
@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(PACKED) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_unpack_state_of_damaged_bytes_raises_only_value_error(changes):
    data = bytearray(PACKED)
    for position, byte in changes:
        data[position] = byte
    try:
        unpack_state(bytes(data))
    except ValueError as err:
        assert "not a state made by pack_state" in str(err)
