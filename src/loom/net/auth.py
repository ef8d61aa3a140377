"""The job secret and the proofs made with it: one parser and one MAC for every authenticated socket of loom
(the store, the ring and gossip links, the parameter servers).

The secret comes from ``LOOM_JOB_SECRET`` (``loom run`` makes 32 random bytes for a one-node job; several nodes
share one). Proofs are HMAC-SHA256 over a label that names the protocol and its direction (``b"loom store
accept"``), so a proof made for one protocol or direction is never accepted by another.
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["MIN_SECRET_BYTES", "job_secret", "mac", "mac_stream", "same_proof"]

MIN_SECRET_BYTES = 16
"""The shortest secret accepted (32 hex digits); ``loom run`` makes 32 bytes."""


def job_secret(text: str | None = None) -> bytes:
    """The job secret from ``text`` or ``LOOM_JOB_SECRET``: hex, at least 32 digits (64 recommended)."""
    raw = (os.environ.get("LOOM_JOB_SECRET", "") if text is None else text).strip()
    try:
        secret = bytes.fromhex(raw)
    except ValueError:
        secret = b""
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            "LOOM_JOB_SECRET must be at least 32 hex digits (64 recommended), "
            f"got {len(raw)} characters{'' if secret or not raw else ' that are not hex'}. "
            "HINT: export LOOM_JOB_SECRET=$(openssl rand -hex 32) on every node, or let `loom run` make one "
            "for a one-node job"
        )
    return secret


def mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``label`` followed by ``parts`` under ``secret``: proofs, and the keys and tokens derived
    from the job secret (each under a label of its own)."""
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def mac_stream(secret: bytes, first: bytes | memoryview = b"") -> hmac.HMAC:
    """The same HMAC-SHA256 as `mac`, to be fed with ``update`` part by part: for frames whose parts are large
    or scattered (a parameter server's tensors), which `mac` would copy into one buffer first."""
    return hmac.new(secret, first, hashlib.sha256)


def same_proof(expected: bytes, got: bytes) -> bool:
    """Whether a received proof is the expected one, in constant time (no timing side channel)."""
    return hmac.compare_digest(expected, got)
