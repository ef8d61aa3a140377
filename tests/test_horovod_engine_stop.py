"""After an elastic kill a `loom.horovod` script is told what is true (issue 36): the engine stopped on a lost
peer, loom restarts the whole group and ``hvd.elastic.run`` resumes from the last commit; "call hvd.init()
again" is said only after ``hvd.shutdown()``."""

from __future__ import annotations

import pytest
import torch

from loom.horovod import _engine
from loom.horovod._request import HorovodInternalError, Request


class _LostPeer(_engine.Engine):
    """An engine whose exchange with its peers fails, as when a peer is killed (gloo raises)."""

    def _exchange(self, message: dict) -> list[dict]:
        raise RuntimeError("Connection closed by peer [10.0.0.2]:1234")


@pytest.mark.unit
@pytest.mark.timeout(20)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_after_a_lost_peer_the_script_is_not_told_to_call_init_again():
    engine = _LostPeer(1, 2, group=None)
    assert engine._stopped.wait(10)
    with pytest.raises(HorovodInternalError) as caught:
        engine.submit(Request("allreduce", [torch.ones(2)], {}), None)
    message = str(caught.value)
    assert "rank 1" in message and "hvd.elastic.run resumes from the last state.commit()" in message
    assert "does not rejoin" in message and "call hvd.init() again." not in message


@pytest.mark.unit
@pytest.mark.timeout(20)
def test_after_shutdown_init_again_is_the_advice():
    engine = _engine.Engine(0, 1, group=None)  # one rank: the exchange is local
    engine.stop()
    with pytest.raises(ValueError, match=r"shut down; call hvd.init\(\) again"):
        engine.submit(Request("allreduce", [torch.ones(2)], {}), None)
