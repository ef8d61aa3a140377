"""Every checkpoint failure line names its errno (issue 37, item 6): an asynchronous save that hits ENOSPC in its
thread reports ``ENOSPC`` through `AsyncCheckpoint.wait` and through `failure_text`, which the ranks' agreement
(`loom.train.fit_checkpoint`) uses for the line the launcher shows."""

from __future__ import annotations

import errno

import pytest
import torch

from loom.checkpoint import CheckpointError, background, save_checkpoint_async
from loom.errors import failure_text


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_an_asynchronous_enospc_keeps_its_errno(tmp_path, monkeypatch):
    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "state.json"))

    monkeypatch.setattr(background, "write_checkpoint", full)
    handle = save_checkpoint_async(tmp_path, 1, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError) as caught:
        handle.wait()
    line = failure_text(caught.value)
    assert "ENOSPC" in str(caught.value) and "errno 28" in str(caught.value), caught.value
    assert line.count("ENOSPC") == 1 and "state.json" in line, line


@pytest.mark.unit
def test_the_errno_is_found_through_the_chain_and_named_once():
    try:
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError as inner:
            raise RuntimeError("publishing failed") from inner
    except RuntimeError as outer:
        assert failure_text(outer) == "RuntimeError: publishing failed [EIO, errno 5: Input/output error]"
    assert failure_text(ValueError("x")) == "ValueError: x"
