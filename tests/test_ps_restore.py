"""STATE and RESTORE on one server, without sockets: what `ParameterServerJob.state_dict` / `load_state_dict` rely on.

The server's handlers are called directly with decoded frames (as in test_ps_units); its replies are captured.
"""

import pytest
import torch

from loom.ps.plan import Piece
from loom.ps.server import ParameterServerProcess, ServerConfig
from loom.ps.wire import MessageType, decode, encode

pytestmark = pytest.mark.unit

SECRET = bytes(range(32))
PIECES = [Piece(0, "w", 0, 3, 1, False, 0, 0), Piece(1, "b", 0, 2, 1, False, 0, 0)]
SETTINGS = {"mode": "sync", "staleness": 0, "num_workers": 2, "timeout_s": 30.0, "checkpoint_every": 0,
            "optimizer": "Adam", "groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]}  # fmt: skip


class Server:
    """A server whose replies and errors are recorded as ``(identity, meta, tensors)`` / ``(identity, error)``."""

    def __init__(self) -> None:
        self.process = ParameterServerProcess(ServerConfig(), SECRET)
        self.replies: list[tuple[bytes, dict, dict]] = []
        self.errors: list[tuple[bytes, str]] = []
        self._seqs: dict[int, int] = {}
        self.process._reply = self._record

    def _record(self, identity: bytes, frame, meta: dict, tensors=None) -> None:
        # Through the wire format, as a client gets it: the tensors are copies, not the server's live values.
        data = encode(SECRET, MessageType.REPLY, epoch=1, session=1, seq=1, meta=meta, tensors=tensors)
        reply = decode(SECRET, data)
        self.replies.append(
            (identity, {k: v for k, v in reply.meta.items() if k != "tensors"}, reply.tensors)
        )
        self.process._error = lambda identity, frame, message: self.errors.append((identity, message))

    def send(self, kind, worker, identity=b"w", meta=None, tensors=None) -> None:
        base = {"ns": "m", "worker": worker, "settings": SETTINGS, "pieces": [p.to_json() for p in PIECES]}
        self.process.handle([_Part(identity), _Part(encode(SECRET, kind, epoch=self.process.epoch,
                            session=1 + worker, seq=self._next(worker), meta={**base, **(meta or {})},
                            tensors=tensors))])  # fmt: skip

    def _next(self, worker: int) -> int:
        self._seqs[worker] = self._seqs.get(worker, 0) + 1
        return self._seqs[worker]

    def step(self, clock: int, value: float) -> None:
        for worker in (0, 1):
            grads = {"g0": torch.full((3,), value * (worker + 1)), "g1": torch.full((2,), -value)}
            self.send(MessageType.PUSH, worker, meta={"clock": clock, "version": clock}, tensors=grads)

    def state(self) -> tuple[dict, dict]:
        self.send(MessageType.STATE, 0, identity=b"state")
        _, meta, tensors = self.replies[-1]
        return meta["state"], tensors

    def restore(self, state: tuple[dict, dict], token: str, worker: int = 0) -> None:
        self.send(MessageType.RESTORE, worker, b"restore", {"token": token, "state": state[0]}, state[1])

    @property
    def shard(self):
        return self.process.models["m"]

    def close(self) -> None:
        self.process.close()


class _Part:
    """What ``recv_multipart(copy=False)`` yields: ``.bytes`` and ``.buffer``."""

    def __init__(self, data: bytes) -> None:
        self.bytes, self.buffer = data, memoryview(data)


@pytest.fixture
def server():
    running = Server()
    # Hellos open the workers' sessions (the replay table refuses frames of unknown sessions).
    for worker in (0, 1):
        hello = encode(SECRET, MessageType.HELLO, epoch=0, session=1 + worker, seq=running._next(worker))
        running.process.handle([_Part(b"hello"), _Part(hello)])
        init = {"p0": torch.tensor([1.0, 2.0, 3.0]), "p1": torch.tensor([0.5, -0.5])}
        running.send(MessageType.INIT, worker, tensors=init)
    try:
        yield running
    finally:
        running.close()


def values(shard) -> dict:
    state = shard.optimizer.state_dict()["state"]
    return {
        "params": [t.detach().clone() for t in shard.params.values()],
        "adam": [{k: v.clone() for k, v in s.items()} for _, s in sorted(state.items())],
    }


def assert_equal(a: dict, b: dict) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
    for x, y in zip(a["adam"], b["adam"], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.timeout(30)
def test_restore_wins_over_later_state_and_then_continues_exactly(server):
    server.step(0, 1.0)
    saved, at_save = server.state(), values(server.shard)
    assert saved[0]["version"] == 1 and saved[0]["clocks"]["clocks"] == [1, 1]
    assert {"piece.0", "piece.1", "opt.0.exp_avg", "opt.0.exp_avg_sq", "opt.0.step"} <= set(saved[1])
    server.step(1, 2.0)
    straight = values(server.shard)
    server.step(2, 3.0)
    # Worker 0's push of step 3 waits for worker 1's, which never comes (the job fails and resumes).
    server.send(MessageType.PUSH, 0, b"parked", {"clock": 3, "version": 3}, {"g0": torch.ones(3)})
    assert server.shard.version == 3 and server.shard.clocks.clocks == [3, 3]
    assert list(server.process.parked_pushes["m"][3]) == [0]

    server.restore(saved, "t1", worker=1)  # any worker may carry it
    assert server.shard.version == 1 and server.shard.clocks.clocks == [1, 1]
    assert_equal(values(server.shard), at_save)
    assert server.replies[-1][1] == {"version": 1, "clocks": [1, 1]}
    assert [identity for identity, _ in server.errors] == [
        b"parked"
    ]  # the old trajectory's waiter is answered
    assert "restored from a checkpoint" in server.errors[0][1]

    server.step(1, 2.0)  # the same step as before the restore: the same result, bitwise
    assert_equal(values(server.shard), straight)
    server.restore(saved, "t1")  # a late copy of the same restore is answered, not applied
    assert server.shard.version == 2 and server.replies[-1][1]["version"] == 2
    server.restore(saved, "t2")  # a new restore is
    assert server.shard.version == 1


@pytest.mark.timeout(30)
def test_restore_refuses_another_plan_or_model_and_unauthenticated_frames(server):
    meta, tensors = server.state()
    other = dict(meta, pieces=[PIECES[0].to_json(), Piece(1, "b", 0, 1, 1, False, 0, 0).to_json()])
    server.restore((other, {**tensors, "piece.1": torch.zeros(1)}), "a")
    assert "differently from this server's plan" in server.errors[-1][1]
    server.restore((dict(meta, settings=dict(SETTINGS, optimizer="SGD")), tensors), "b")
    assert "saved state is for SGD" in server.errors[-1][1]
    server.restore((meta, {k: v for k, v in tensors.items() if k != "piece.0"}), "c")
    assert "not a parameter-server shard state" in server.errors[-1][1]
    server.send(MessageType.RESTORE, 0, meta={"ns": "nope", "token": "d", "state": meta}, tensors=tensors)
    assert "was not initialized" in server.errors[-1][1]
    assert server.shard.version == 0 and len(server.errors) == 4

    forged = encode(b"x" * 32, MessageType.RESTORE, epoch=server.process.epoch, session=1, seq=99,
                    meta={"ns": "m", "worker": 0, "token": "e", "state": meta}, tensors=tensors)  # fmt: skip
    server.step(0, 1.0)
    server.process.handle([_Part(b"forged"), _Part(forged)])
    assert server.process.counters.dropped.get("bad_mac") == 1 and server.shard.version == 1
    with pytest.raises(Exception, match="bad_mac"):
        decode(SECRET, forged)
