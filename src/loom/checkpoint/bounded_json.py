"""Parse JSON from a checkpoint only after checking, without recursion, that parsing it is cheap and safe.

Python's `json.loads` recurses once per nesting level (a few thousand ``[`` raise `RecursionError`), refuses
integers longer than ``sys.int_max_str_digits`` (and converts long ones in quadratic time), and builds an
object per value. `parse_json` measures all three on the raw bytes first, in linear passes in C (regular
expressions, `bytes.count`) and numpy: once every backslash escape and then every string is removed, what is
left holds only brackets, commas, colons, numbers and literals, so the longest run of digits is the longest
number, commas plus ``[`` plus ``{`` count the values, and the running sum of +1 per ``[``/``{`` and -1 per
``]``/``}`` is the nesting depth (summed in chunks, so the scan's memory is bounded). On JSON that is not valid
the scan may over- or under-count, but only in text `json.loads` then rejects before it nests any deeper than
the scan saw.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from loom.checkpoint.limits import ReadLimits
from loom.errors import JSONLimitError  # noqa: F401 - raised here, defined there

__all__ = ["JSONLimitError", "count_json_values", "json_shape_problem", "parse_json"]

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENING = np.zeros(256, dtype=np.int8)
_OPENING[list(b"[{")] = 1
_CHUNK = 1 << 22


def _max_depth(brackets: bytes) -> int:
    """The deepest nesting in a string of brackets alone, scanned in chunks of bounded size."""
    depth = deepest = 0
    for start in range(0, len(brackets), _CHUNK):
        chunk = np.frombuffer(
            brackets, dtype=np.uint8, count=min(_CHUNK, len(brackets) - start), offset=start
        )
        running = np.cumsum(_OPENING[chunk].astype(np.int32) * 2 - 1, dtype=np.int64) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest


_SCAN = 1 << 20
"""Bytes of JSON scanned at a time: ``re.sub`` keeps one object per match until it joins them (~28 bytes of
memory per input byte for a document of short strings), so the scan's memory is bounded by the piece, not by
the document."""


def _skeleton(data: bytes) -> bytes:
    """``data`` without its escapes and strings: brackets, commas, colons, numbers and literals; scanned in
    pieces of about `_SCAN` bytes, each ending where no escape or string is open. Each escape is first replaced
    by two bytes that are neither quotes nor backslashes, so positions in a piece stay those of ``data``."""
    parts, start, size = [], 0, len(data)
    while start < size:
        end = min(size, start + _SCAN)
        while True:
            piece = _ESCAPE.sub(b"__", data[start:end])
            # a backslash at the piece's end escapes the next byte: cut before it
            cut = len(piece) - 1 if end < size and piece.endswith(b"\\") else len(piece)
            if end < size and piece.count(b'"', 0, cut) % 2:
                cut = piece.rfind(b'"', 0, cut)  # the string still open at the piece's end starts here
            if cut > 0 or end == size:
                end, piece = start + cut, piece[:cut]
                break
            end = min(size, start + 2 * (end - start))  # one string longer than the piece: a longer piece
        parts.append(_STRING.sub(b"", piece))
        start = end
    return b"".join(parts)


def _values(skeleton: bytes) -> int:
    return skeleton.count(b",") + skeleton.count(b"[") + skeleton.count(b"{") + 1


def count_json_values(data: bytes) -> int:
    """How many values `parse_json` counts in ``data`` (commas plus opening brackets plus one), without
    parsing it: what a checkpoint's manifest records so that reading can be bounded by it."""
    return _values(_skeleton(data))


def json_shape_problem(data: bytes, limits: ReadLimits, size_field: str) -> JSONLimitError | None:
    """Why parsing ``data`` would break ``limits`` (None if it would not), found without parsing it.
    ``size_field`` names the `ReadLimits` field that bounds this document's size."""
    max_bytes = getattr(limits, size_field)
    if len(data) > max_bytes:
        return JSONLimitError(f"{len(data)} bytes of JSON, more than the limit of {max_bytes}", size_field)
    skeleton = _skeleton(data)
    if re.search(rb"[0-9]{%d}" % (limits.max_number_digits + 1), skeleton):
        return JSONLimitError(
            f"a number of more than {limits.max_number_digits} digits (no checkpoint value needs one)",
            "max_number_digits",
        )
    values = _values(skeleton)
    if values > limits.max_json_values:
        return JSONLimitError(
            f"about {values} JSON values, more than the limit of {limits.max_json_values}", "max_json_values"
        )
    depth = _max_depth(skeleton.translate(None, _NOT_BRACKETS))
    if depth > limits.max_json_depth:
        return JSONLimitError(
            f"JSON nested {depth} levels deep, deeper than the limit of {limits.max_json_depth}",
            "max_json_depth",
        )
    return None


def parse_json(data: bytes, limits: ReadLimits, size_field: str) -> Any:
    """``json.loads(data)`` once `json_shape_problem` finds nothing; raises `JSONLimitError` over a limit and
    ``ValueError`` for text that is not UTF-8 JSON, never `RecursionError` or a conversion error."""
    problem = json_shape_problem(data, limits, size_field)
    if problem is not None:
        raise problem
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 ({err})") from None
    except ValueError as err:  # JSONDecodeError, or a number Python's own digit limit refuses
        raise ValueError(f"not valid JSON ({err})") from None
