"""Compact, bit-exact encoding of token arrays: one tag byte, then little-endian values.

``i`` int32 / ``q`` int64 for ids; ``f`` float32 / ``d`` float64 for logprobs. Floats are stored as float32
only when every value survives the round trip exactly (engine logprobs usually are float32 numbers), so
decoding always returns the very floats that were encoded.

Encoding is on the span export hot path: ``struct`` with a cached compiled format per (tag, length) packs
a list about twice as fast as ``array(...).tobytes()``.
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
    """``<{n}{tag}``: ``n`` little-endian values (the tag byte is prepended by the caller: passing it as a
    pack argument costs more than the concatenation)."""
    return struct.Struct(f"<{n}{tag}")


def encode_ints(xs: Sequence[int]) -> bytes:
    try:
        return b"i" + _packer("i", len(xs)).pack(*xs)
    except struct.error:  # out of int32 range (or not integers: then int64 packing raises too)
        try:
            return b"q" + _packer("q", len(xs)).pack(*xs)
        except struct.error as e:
            raise ValueError(f"token ids must be integers within int64: {e}") from None


def encode_floats(xs: Sequence[float]) -> bytes:
    n = len(xs)
    f32 = _packer("f", n)
    try:
        blob = f32.pack(*xs)
    except OverflowError:  # beyond float32 range: float64 keeps it exactly
        blob = None
    except struct.error as e:
        raise ValueError(f"logprobs must be numbers: {e}") from None
    if blob is not None and f32.unpack(blob) == tuple(xs):
        return b"f" + blob
    return b"d" + _packer("d", n).pack(*xs)


_TAGS = {ord(t): t for t in "iqfd"}


def decode_array(blob: bytes | memoryview | None) -> array | None:
    """The blob's values as an ``array`` of its own type (``i``/``q``/``f``/``d``), with no Python object per
    value; None stays None. What the assembly read path hands out: arrays compare and slice at C speed.
    (``array(tag, blob[1:])`` is one C call: ~4x cheaper than an empty array plus ``frombytes`` of a
    memoryview slice, and this runs three times per span read.)"""
    if blob is None:
        return None
    if not blob:
        raise ValueError("empty token array blob (missing type tag)")
    if type(blob) is not bytes:  # array(tag, x) iterates anything but bytes/bytearray value by value
        blob = bytes(blob)
    tag = _TAGS.get(blob[0])
    if tag is None:
        raise ValueError(f"unknown token array tag {chr(blob[0])!r} (expected one of i, q, f, d)")
    arr = array(tag, blob[1:])  # ValueError when the length is not a multiple of the item size
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr


def decode(blob: bytes | memoryview | None) -> list | None:
    """Inverse of ``encode_ints`` / ``encode_floats``; None stays None."""
    arr = decode_array(blob)
    return None if arr is None else arr.tolist()
