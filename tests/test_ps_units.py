"""Parameter-server pieces without processes: framing, replay protection, shard plan, clocks, checkpoints."""

import os
import struct

import pytest
import torch

from loom.ps.clocks import ClockTable
from loom.ps.plan import ParamSpec, plan_shards, server_loads
from loom.ps.shard import ModelShard, ShardSettings
from loom.ps.wire import (
    DTYPES,
    HEADER,
    MAC_BYTES,
    FrameDropped,
    MessageType,
    SessionTable,
    WireLimits,
    decode,
    encode,
)

pytestmark = pytest.mark.unit

SECRET = bytes(range(32))


def frame(seq=1, epoch=7, kind=MessageType.PUSH, tensors=None, secret=SECRET) -> bytes:
    return encode(secret, kind, epoch=epoch, session=42, seq=seq, meta={"ns": "m"}, tensors=tensors)


DEFAULT_LIMITS = WireLimits()


def reason(data, limits=DEFAULT_LIMITS, secret=SECRET) -> str:
    with pytest.raises(FrameDropped) as info:
        decode(secret, data, limits)
    return info.value.reason


@pytest.mark.timeout(30)
def test_round_trip_every_dtype_and_empty_tensors():
    tensors = {name: torch.arange(6).to(dtype).view(2, 3) for name, dtype in DTYPES.items()}
    tensors["empty"] = torch.zeros(0, 4)
    tensors["scalar"] = torch.tensor(3.5)
    got = decode(SECRET, frame(tensors=tensors))
    assert got.type == MessageType.PUSH and got.meta["ns"] == "m" and (got.session, got.seq) == (42, 1)
    for name, value in tensors.items():
        assert got.tensors[name].dtype == value.dtype and torch.equal(got.tensors[name], value), name
    got.tensors["float32"] += 1  # decoded tensors own their memory (a copy of the checked payload)


@pytest.mark.timeout(30)
def test_tampering_anywhere_fails_the_mac():
    data = frame(tensors={"g0": torch.ones(4)})
    for position in (10, HEADER.size + 2, len(data) - MAC_BYTES - 1, len(data) - 1):
        bad = bytearray(data)
        bad[position] ^= 1
        assert reason(bytes(bad)) in ("bad_mac", "bad_magic"), position
    assert reason(frame(secret=b"x" * 32)) == "bad_mac"


@pytest.mark.timeout(30)
def test_sizes_are_checked_before_anything_is_allocated():
    data = frame(tensors={"g0": torch.ones(4)})
    assert reason(data[:20]) == "truncated"
    assert reason(data[:-5]) == "truncated"
    assert reason(data + b"\0") == "length_mismatch"
    fields = list(HEADER.unpack_from(data))
    fields[-1] = 1 << 40  # declares a terabyte of payload
    huge = HEADER.pack(*fields) + data[HEADER.size :]
    assert reason(huge) == "oversized"
    fields[-1], fields[-3] = 16, 1 << 30  # a gigabyte of metadata
    assert reason(HEADER.pack(*fields) + data[HEADER.size :]) == "oversized"
    assert reason(data, WireLimits(max_payload=8)) == "oversized"
    assert reason(b"\0" * 10_000_000, WireLimits(max_payload=1000)) == "oversized"
    for n in (0, 1, 79, 80, 1000):
        assert reason(os.urandom(n)) in ("truncated", "bad_magic")


@pytest.mark.timeout(30)
def test_authenticated_but_inconsistent_descriptors_are_malformed():
    def forged(meta: bytes, payload: bytes, n_tensors: int) -> bytes:
        import hashlib
        import hmac

        header = struct.pack("<4sBBHQQQIIQ", b"LMPS", 1, 5, 0, 7, 42, 1, len(meta), n_tensors, len(payload))
        return header + meta + payload + hmac.new(SECRET, header + meta + payload, hashlib.sha256).digest()

    assert reason(forged(b'{"tensors":[["g0","float32",[4]]]}', b"\0" * 8, 1)) == "malformed"
    assert reason(forged(b'{"tensors":[["g0","pickle",[1]]]}', b"\0" * 4, 1)) == "malformed"
    assert reason(forged(b'{"tensors":[]}', b"", 1)) == "malformed"
    assert reason(forged(b"not json", b"", 0)) == "malformed"
    assert (
        decode(SECRET, forged(b'{"tensors":[["g0","float32",[1]]]}', b"\0" * 4, 1)).tensors["g0"].item() == 0
    )


@pytest.mark.timeout(30)
def test_session_table_rejects_replays_and_old_epochs():
    table = SessionTable(epoch=7)
    hello = decode(SECRET, frame(seq=1, epoch=0, kind=MessageType.HELLO))
    push = decode(SECRET, frame(seq=2))
    with pytest.raises(FrameDropped, match="unknown_session"):
        table.admit(push)
    table.admit(hello)
    with pytest.raises(FrameDropped, match="replay"):
        table.admit(hello)
    table.admit(push)
    with pytest.raises(FrameDropped, match="replay"):
        table.admit(push)
    with pytest.raises(FrameDropped, match="stale_epoch"):
        table.admit(decode(SECRET, frame(seq=3, epoch=6)))
    table.admit(decode(SECRET, frame(seq=9)))


@pytest.mark.timeout(30)
def test_plan_balances_and_splits_large_tensors():
    specs = [ParamSpec("big", 1000, 1, False, 0), ParamSpec("b", 10, 1, False, 0),
             ParamSpec("emb", 300, 4, True, 1), ParamSpec("small", 3, 1, False, 0)]  # fmt: skip
    for k in (1, 2, 3, 5):
        pieces = plan_shards(specs, k)
        loads = server_loads(pieces, k)
        assert sum(loads) == 2213 and max(loads) - min(loads) <= 2 * 4, (k, loads)
        for spec in specs:  # every row of every parameter is covered exactly once
            mine = sorted((p.start, p.stop) for p in pieces if p.name == spec.name)
            assert mine[0][0] == 0 and mine[-1][1] == spec.rows
            assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))
        assert len(pieces) <= len(specs) + k - 1
    assert plan_shards(specs, 3) == plan_shards(specs, 3)


@pytest.mark.timeout(30)
def test_ssp_clock_table_bounds_the_lead_and_forgets_lost_workers():
    table = ClockTable(3, "ssp", staleness=1, timeout_s=5.0)
    for w in range(3):
        table.seen(w, 0.0)
    assert table.may_pull(0, 1)
    table.pushed(0, 0)
    table.pushed(0, 1)
    assert not table.may_pull(0, 2)  # 2 - 0 > 1
    table.pushed(1, 0)
    table.pushed(2, 0)
    assert table.may_pull(0, 2)
    assert table.pushed(0, 1) is False  # duplicate
    assert table.expire(4.0) == [] and table.expire(6.0, frozenset({0})) == [1, 2]
    assert table.slowest() == 2 and table.may_pull(0, 3)
    assert table.seen(1, 7.0) is True and table.status[1] == "active"
    table.finish(1)
    assert 1 not in table.active()
    assert ClockTable(2, "async").may_pull(0, 100)


@pytest.mark.timeout(30)
def test_shard_checkpoint_round_trip_with_adam_state(tmp_path):
    from loom.ps.plan import Piece

    pieces = [Piece(0, "w", 0, 6, 1, False, 0, 0), Piece(1, "emb", 2, 5, 3, True, 0, 0)]
    settings = ShardSettings("async", 0, 2, 10.0, 0, "Adam", [{"lr": 0.01, "betas": [0.9, 0.99]}])
    shard = ModelShard("m", settings, pieces, {0: torch.randn(6), 1: torch.randn(3, 3)})
    shard.apply([{"g0": torch.ones(6)}])
    shard.record_staleness(1)
    shard.clocks.pushed(1, 0)
    shard.save(tmp_path)
    shard.save(tmp_path)  # the second save replaces the first
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    again = ModelShard.load(tmp_path / "m.json")
    assert again.version == 1 and again.staleness_histogram == {1: 1} and again.clocks.clocks == [0, 1]
    for i in (0, 1):
        assert torch.equal(again.params[i], shard.params[i])
    for copy in (shard, again):
        copy.apply([{"g0": torch.full((6,), 0.5)}])
    assert torch.equal(again.params[0], shard.params[0])  # same Adam moments after the restore
    with pytest.raises(ValueError, match="cannot run sharded"):
        ModelShard("x", ShardSettings("sync", 0, 1, 1.0, 0, "LBFGS", [{}]), pieces[:1], {0: torch.ones(6)})


@pytest.mark.timeout(30)
def test_pushed_learning_rates_reach_the_right_param_groups():
    from loom.ps.plan import Piece

    # Three param groups; this server holds pieces of groups 0 and 2 only, so its optimizer has two groups.
    pieces = [Piece(0, "a", 0, 2, 1, False, 0, 0), Piece(1, "c", 0, 2, 1, False, 2, 0)]
    groups = [{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}]
    settings = ShardSettings("async", 0, 1, 10.0, 0, "SGD", groups)
    shard = ModelShard("m", settings, pieces, {0: torch.zeros(2), 1: torch.zeros(2)})
    shard.apply([{"g0": torch.ones(2), "g1": torch.ones(2)}], lrs=[1.0, 2.0, 3.0])
    assert torch.equal(shard.params[0].detach(), torch.full((2,), -1.0))
    assert torch.equal(shard.params[1].detach(), torch.full((2,), -3.0))
    shard.apply([{"g0": torch.ones(2), "g1": torch.ones(2)}])  # no lrs: the last ones stay
    assert torch.equal(shard.params[1].detach(), torch.full((2,), -6.0))
    for bad, message in [([1.0, 2.0], "one learning rate per param group"), ([1.0, float("nan"), 1.0], "nan"),
                         ([1.0, -1.0, 1.0], "-1.0"), ([1.0, True, 1.0], "True"), ("0.1", "per param group")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            shard.check_learning_rates(bad)
    assert shard.version == 2  # nothing applied by the rejected ones


@pytest.mark.timeout(30)
def test_a_rejoining_worker_is_active_again_at_its_clock():
    table = ClockTable(2, "ssp", staleness=0, timeout_s=1.0)
    table.pushed(0, 0)
    table.pushed(0, 1)
    assert table.expire(time_after_timeout := table.last_seen[0] + 2.0) == [0, 1]
    assert table.rejoin(0, time_after_timeout) == 2 and table.status == ["active", "lost"]
    table.finish(1)
    assert table.rejoin(1, time_after_timeout) == 0 and table.active() == [0, 1]


@pytest.mark.timeout(30)
def test_a_restarted_worker_drops_its_parked_sync_push():
    """Worker 0's push of step 0 waits for worker 1 when the job restarts. The new worker 0 re-INITs; worker 1's
    push must then wait for the new worker 0's push instead of completing the step with the dead one's gradient."""
    from loom.ps.plan import Piece
    from loom.ps.server import ParameterServerProcess, ServerConfig
    from loom.ps.wire import Frame

    server = ParameterServerProcess(ServerConfig(), SECRET)
    replies: list[tuple[bytes, dict]] = []
    server._reply = lambda identity, frame, meta, tensors=None: replies.append((identity, meta))
    piece = Piece(0, "w", 0, 2, 1, False, 0, 0)
    settings = {"mode": "sync", "staleness": 0, "num_workers": 2, "timeout_s": 30.0, "checkpoint_every": 0,
                "optimizer": "SGD", "groups": [{"lr": 1.0}]}  # fmt: skip

    def message(kind, worker, meta=None, tensors=None):
        base = {"ns": "m", "worker": worker, "settings": settings, "pieces": [piece.to_json()], "version": 0}
        return Frame(kind, server.epoch, 1, 1, {**base, **(meta or {})}, tensors or {})

    def push(identity, worker, value):
        grads = {"g0": torch.full((2,), float(value))}
        server._push(identity, message(MessageType.PUSH, worker, {"clock": 0, "loss_sum": value}, grads))

    try:
        for worker in (0, 1):
            server._init(b"init", message(MessageType.INIT, worker, tensors={"p0": torch.zeros(2)}))
        push(b"old-0", 0, 100.0)  # the first attempt of worker 0; then the job restarts
        server._init(b"init", message(MessageType.INIT, 0, tensors={"p0": torch.zeros(2)}))
        push(b"new-1", 1, 1.0)
        # The step waits for the new worker 0.
        assert [identity for identity, _ in replies if identity != b"init"] == []
        push(b"new-0", 0, 3.0)
        answered = {identity: meta for identity, meta in replies if identity != b"init"}
        assert set(answered) == {b"new-0", b"new-1"} and answered[b"new-0"]["loss_sum"] == 4.0
        # 1 + 3: the workers scale their gradients to the global batch before pushing.
        assert torch.equal(server.models["m"].params[0].detach(), torch.full((2,), -4.0))
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_a_model_whose_share_on_one_server_exceeds_a_frame_is_refused_naming_the_servers_it_needs():
    """Each server's pieces travel in one frame (INIT, push, reply); a frame above the wire's payload limit is
    dropped by its receiver: the workers waited 60 s and were told the server was hung or overloaded."""
    from loom.ps.plan import check_frames

    limit = WireLimits().max_payload
    params = {"w": torch.empty(0)}  # float32: 4 bytes per element; nothing of the model's size is allocated
    specs = [ParamSpec("w", limit // 4 + 1024, 1, False, 0)]
    with pytest.raises(ValueError, match=r"server 0 of 1 would hold .* HINT: launch with more servers \(loom run "
                                         r"--servers 2 or more\)"):  # fmt: skip
        check_frames(plan_shards(specs, 1), params, 1)
    check_frames(plan_shards(specs, 2), params, 2)  # half each: fits


def test_a_frame_reaches_only_the_handler_named_after_its_request_type():
    from loom.ps.handlers import HANDLERS, RequestHandlers
    from loom.ps.wire import MessageType

    requests = [kind for kind in MessageType if kind < MessageType.REPLY]
    assert set(HANDLERS) == set(requests)  # REPLY and ERROR are answers, never dispatched
    for kind in requests:
        assert HANDLERS[kind] is vars(RequestHandlers)[f"_{kind.name.lower()}"]
