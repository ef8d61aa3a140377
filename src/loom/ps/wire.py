"""Authenticated frames for the parameter-server transport: a small header, JSON metadata, raw tensor bytes, a MAC.

A frame travels as a sequence of chunks, each one ZeroMQ message, reassembled under budgets (`loom.ps.gate`)::

    header (48 bytes, little-endian)  magic "LMPS" | version u8 | type u8 | flags u16 | epoch u64 | session u64
                                      | seq u64 | meta_len u32 | n_tensors u32 | payload_len u64
    meta      (meta_len bytes)        UTF-8 JSON: {"tensors": [[name, dtype, shape], ...], ...message fields}
    payload   (payload_len bytes)     the tensors' raw bytes, back to back, in the order of meta["tensors"]
    mac       (32 bytes)              HMAC-SHA256(job secret, header + meta + payload)

No pickle: the only things decoded are a fixed struct, JSON (after the MAC is checked) and raw bytes viewed as
tensors of a dtype from a fixed table. `decode` checks, in order and before allocating anything: the size of what
actually arrived, the magic and version, the *declared* lengths against the limits and against the bytes that
arrived, then the MAC; only then does it parse the JSON and copy the payload (whose size is now known to be the
real, bounded size). A declared length is never used to allocate.

Replay: the MAC covers the server's random *epoch* (drawn at its start), the client's random *session* and a
sequence number strictly increasing within it, so a captured frame can be replayed neither within a session nor
against a restarted server (`SessionTable`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any

import torch

from loom.errors import FrameDropped
from loom.net.auth import job_secret, mac_stream, same_proof

__all__ = [
    "DTYPES",
    "DropCounters",
    "Frame",
    "FrameDropped",
    "HEADER",
    "MAC_BYTES",
    "MessageType",
    "SessionTable",
    "WireLimits",
    "decode",
    "encode",
    "read_header",
    "secret_from_hex",
]

MAGIC = b"LMPS"
VERSION = 1
HEADER = struct.Struct("<4sBBHQQQIIQ")
MAC_BYTES = 32
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class MessageType(IntEnum):
    """Requests a worker sends (HELLO .. RESTORE; each handled in `loom.ps.handlers`) and a server's two answers."""

    HELLO = 1
    INIT = 2
    PULL = 3
    PULL_ROWS = 4
    PUSH = 5
    BYE = 6
    STATS = 7
    SAVE = 8
    STATE = 9
    RESTORE = 10
    REPLY = 64
    ERROR = 65


@dataclass(frozen=True)
class WireLimits:
    """Upper bounds a receiver enforces before looking inside a frame."""

    max_payload: int = 256 << 20
    """Largest tensor payload accepted, in bytes."""
    max_meta: int = 1 << 20
    """Largest JSON metadata block, in bytes."""
    max_tensors: int = 65536
    """Most tensors in one frame."""

    @property
    def max_frame(self) -> int:
        return HEADER.size + self.max_meta + self.max_payload + MAC_BYTES


@dataclass
class Frame:
    """A decoded, authenticated frame."""

    type: MessageType
    epoch: int
    session: int
    seq: int
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    nbytes: int = 0
    """Size of the frame on the wire."""


secret_from_hex = job_secret
"""The job secret as bytes from its hex (``loom run`` hands out 32 random bytes), checked by `job_secret`."""


def encode(
    secret: bytes,
    kind: MessageType,
    *,
    epoch: int,
    session: int,
    seq: int,
    meta: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> bytearray:
    """One frame: header, JSON meta (with the tensor descriptors), raw tensor bytes, HMAC. Each tensor's bytes are
    copied once, straight into the frame (joining per-tensor copies would copy them three times)."""
    descriptors, blobs = [], []
    for name, tensor in (tensors or {}).items():
        t = tensor.detach().contiguous().cpu()
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which the wire format does not carry")
        descriptors.append([name, _DTYPE_NAMES[t.dtype], list(t.shape)])
        blobs.append(t.reshape(-1).view(torch.uint8).numpy())  # a view of the tensor's bytes, not a copy
    body = json.dumps({**(meta or {}), "tensors": descriptors}, separators=(",", ":")).encode()
    payload = sum(blob.nbytes for blob in blobs)
    header = HEADER.pack(MAGIC, VERSION, int(kind), 0, epoch, session, seq, len(body), len(blobs), payload)
    frame = bytearray(HEADER.size + len(body) + payload + MAC_BYTES)
    view = memoryview(frame)
    end = HEADER.size + len(body)
    view[:end] = header + body
    for blob in blobs:
        view[end : end + blob.nbytes] = blob.data
        end += blob.nbytes
    view[end:] = mac_stream(secret, view[:end]).digest()
    return frame


def decode(secret: bytes, data: bytes | memoryview, limits: WireLimits = WireLimits()) -> Frame:
    """Check and decode one frame, or raise `FrameDropped` with the reason. See the module docstring."""
    view = memoryview(data).cast("B")
    size = len(view)
    if size > limits.max_frame:
        raise FrameDropped("oversized", f"{size} bytes arrived")
    if size < HEADER.size + MAC_BYTES:
        raise FrameDropped("truncated", f"{size} bytes, shorter than a header")
    kind, epoch, session, seq, meta_len, n_tensors, declared = read_header(view, limits)
    if declared != size:
        raise FrameDropped("truncated" if declared > size else "length_mismatch", f"{declared} != {size}")
    expected = mac_stream(secret, view[: size - MAC_BYTES]).digest()
    if not same_proof(expected, bytes(view[size - MAC_BYTES :])):
        raise FrameDropped("bad_mac")
    try:
        kind = MessageType(kind)
        meta = json.loads(bytes(view[HEADER.size : HEADER.size + meta_len]))
    except (ValueError, UnicodeDecodeError) as error:
        raise FrameDropped("malformed", str(error)) from None
    start = HEADER.size + meta_len
    tensors = _tensors(meta, n_tensors, view[start : size - MAC_BYTES])
    return Frame(kind, epoch, session, seq, meta, tensors, size)


def read_header(data: bytes | memoryview, limits: WireLimits, offset: int = 0) -> tuple[int, ...]:
    """The header at ``offset``: ``(type, epoch, session, seq, meta_len, n_tensors, frame size)``, after its
    magic, version and declared lengths are checked against ``limits`` (`FrameDropped` otherwise): what a
    receiver knows before it holds any of the frame."""
    magic, version, kind, _, epoch, session, seq, meta_len, n_tensors, payload_len = HEADER.unpack_from(
        data, offset
    )
    if magic != MAGIC:
        raise FrameDropped("bad_magic")
    if version != VERSION:
        raise FrameDropped("bad_version", f"version {version}")
    if meta_len > limits.max_meta or payload_len > limits.max_payload or n_tensors > limits.max_tensors:
        raise FrameDropped("oversized", f"declares meta {meta_len} B, payload {payload_len} B")
    return kind, epoch, session, seq, meta_len, n_tensors, HEADER.size + meta_len + payload_len + MAC_BYTES


def _tensors(meta: Any, n_tensors: int, payload: memoryview) -> dict[str, torch.Tensor]:
    """View the payload as the tensors its (authenticated) descriptors announce, after checking they tile it."""
    descriptors = meta.get("tensors") if isinstance(meta, dict) else None
    if not isinstance(descriptors, list) or len(descriptors) != n_tensors:
        raise FrameDropped("malformed", "tensor descriptors do not match the header")
    layout, offset = [], 0
    for item in descriptors:
        if not (
            isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and _NAME.match(item[0])
        ):
            raise FrameDropped("malformed", "bad tensor descriptor")
        name, dtype_name, shape = item
        dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None or not isinstance(shape, list) or len(shape) > 8:
            raise FrameDropped("malformed", f"bad dtype or shape for {name!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
            raise FrameDropped("malformed", f"bad shape for {name!r}")
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if offset + nbytes > len(payload):
            raise FrameDropped("malformed", "tensors overrun the payload")
        layout.append((name, dtype, shape, offset, numel))
        offset += nbytes
    if offset != len(payload):
        raise FrameDropped("malformed", "tensors do not fill the payload")
    owned = bytearray(payload)  # the real, bounded payload size: the only allocation driven by the frame
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, start, numel in layout:
        if name in out:
            raise FrameDropped("malformed", f"tensor {name!r} appears twice")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(owned, dtype=dtype, count=numel, offset=start).view(shape)
    return out


@dataclass
class DropCounters:
    """Frames dropped, by reason; plus frames and bytes accepted."""

    dropped: dict[str, int] = field(default_factory=dict)
    accepted: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return asdict(self)  # a copy: ``dropped`` too


class SessionTable:
    """Replay protection on the server: per-session last sequence number, under this server's epoch (a HELLO,
    which opens its session, carries epoch 0: the client does not know the epoch yet).

    The table keeps the ``capacity`` most recently active sessions (a bound on memory against floods of
    authenticated hellos, which only holders of the secret can produce); a session evicted and then replayed
    against could accept an old frame, so ``capacity`` should exceed the number of clients by a wide margin."""

    def __init__(self, epoch: int, capacity: int = 4096) -> None:
        self.epoch = epoch
        self.capacity = capacity
        self._last: OrderedDict[int, int] = OrderedDict()

    def check(self, kind: int, epoch: int, session: int, seq: int) -> None:
        """Raise `FrameDropped` unless a frame with these header fields would be fresh; records nothing (a
        receiver peeks with it before it keeps a frame's bytes)."""
        if epoch != (0 if kind == MessageType.HELLO else self.epoch):
            raise FrameDropped("stale_epoch")
        last = self._last.get(session)
        if last is None and kind != MessageType.HELLO:
            raise FrameDropped("unknown_session")
        if last is not None and seq <= last:
            raise FrameDropped("replay")

    def admit(self, frame: Frame) -> None:
        """Raise `FrameDropped` unless ``frame`` is fresh; record its sequence number."""
        self.check(frame.type, frame.epoch, frame.session, frame.seq)
        self._last[frame.session] = frame.seq
        self._last.move_to_end(frame.session)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
