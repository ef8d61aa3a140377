"""help() on every strategy shows each option with its default and meaning."""

from __future__ import annotations

import dataclasses
import pydoc

import pytest

import loom
from loom.config_docs import field_docs

pytestmark = pytest.mark.unit


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "strategy, configs",
    [
        (loom.DataParallel, [loom.DataParallelConfig]),
        (loom.ParameterServer, [loom.ParameterServerConfig]),
        (loom.Pipeline, [loom.PipelineConfig, loom.DataParallelConfig]),
        (loom.TensorParallel, [loom.TensorParallelConfig, loom.DataParallelConfig]),
        (loom.Hybrid, [loom.HybridConfig, loom.DataParallelConfig]),
    ],
)
def test_help_shows_every_option_with_its_default_and_meaning(strategy, configs):
    shown = " ".join(pydoc.render_doc(strategy, renderer=pydoc.plaintext).split())
    for config in configs:
        docs = field_docs(config)
        for field in dataclasses.fields(config):
            assert docs.get(field.name), f"{config.__name__}.{field.name} has no docstring"
            first_words = " ".join(docs[field.name].split()[:6])
            assert f"{field.name} = " in shown and first_words in shown, f"{strategy.__name__}: {field.name}"
