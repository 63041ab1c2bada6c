"""Compact, bit-exact encoding of token arrays: one tag byte, then little-endian values.

``i`` int32 / ``q`` int64 for ids; ``f`` float32 / ``d`` float64 for logprobs. Floats are stored as float32
only when every value survives the round trip exactly (engine logprobs usually are float32 numbers), so
decoding always returns the very floats that were encoded.

Encoding is on the span export hot path: ``struct`` with a cached compiled format per (tag, length) packs
a list about twice as fast as ``array(...).tobytes()`` and writes the tag byte in the same pass.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache

_BIG_ENDIAN = sys.byteorder == "big"


@lru_cache(maxsize=1024)
def _packer(tag: str, n: int) -> struct.Struct:
    """``<c{n}{tag}``: the tag byte, then ``n`` little-endian values."""
    return struct.Struct(f"<c{n}{tag}")


def encode_ints(xs: Sequence[int]) -> bytes:
    try:
        return _packer("i", len(xs)).pack(b"i", *xs)
    except struct.error:  # out of int32 range (or not integers: then int64 packing raises too)
        try:
            return _packer("q", len(xs)).pack(b"q", *xs)
        except struct.error as e:
            raise ValueError(f"token ids must be integers within int64: {e}") from None


def encode_floats(xs: Sequence[float]) -> bytes:
    n = len(xs)
    f32 = _packer("f", n)
    try:
        blob = f32.pack(b"f", *xs)
    except OverflowError:  # beyond float32 range: float64 keeps it exactly
        blob = b""
    except struct.error as e:
        raise ValueError(f"logprobs must be numbers: {e}") from None
    if blob and f32.unpack(blob)[1:] == tuple(xs):
        return blob
    return _packer("d", n).pack(b"d", *xs)


_TAGS = {ord(t): t for t in "iqfd"}


def decode_array(blob: bytes | memoryview | None) -> array | None:
    """The blob's values as an ``array`` of its own type (``i``/``q``/``f``/``d``), with no Python object per
    value; None stays None. What the assembly read path hands out: arrays compare and slice at C speed."""
    if blob is None:
        return None
    if not blob:
        raise ValueError("empty token array blob (missing type tag)")
    tag = _TAGS.get(blob[0])
    if tag is None:
        raise ValueError(f"unknown token array tag {chr(blob[0])!r} (expected one of i, q, f, d)")
    arr = array(tag)
    arr.frombytes(memoryview(blob)[1:])
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr


def decode(blob: bytes | memoryview | None) -> list | None:
    """Inverse of ``encode_ints`` / ``encode_floats``; None stays None."""
    arr = decode_array(blob)
    return None if arr is None else arr.tolist()
