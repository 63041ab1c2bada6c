"""The storage encoding of token arrays (the store's columns, OTLP span attributes): one tag byte, then
little-endian values; compact and bit-exact.

``i`` int32 / ``q`` int64 for ids; ``f`` float32 / ``d`` float64 for logprobs. Floats are stored as float32
only when every value survives the round trip exactly (engine logprobs usually are float32 numbers), so
decoding always returns the very floats that were encoded.

This is the form at rest, as JSON is on the wire: in memory, token arrays are numpy arrays
(``tracegym.arrays``; ``DTYPES`` below gives a tag's numpy type). The assembly works on the blobs
themselves (two id blobs of one tag hold equal ids exactly when their bytes are equal) and reads their
values through ``token_calls.values``, a numpy view; ``decode`` gives the lists of a ``CallRecord`` or a
span's JSON.

Encoding is on the span export hot path: ``struct`` with a cached compiled format per (tag, length) packs
a list faster than ``array(...).tobytes()``.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from tracegym.arrays import LOGPROB_DTYPE, TOKEN_ID_DTYPES

_BIG_ENDIAN = sys.byteorder == "big"

DTYPES: dict[int, np.dtype] = {
    ord("i"): TOKEN_ID_DTYPES[0].newbyteorder("<"),
    ord("q"): TOKEN_ID_DTYPES[1].newbyteorder("<"),
    ord("f"): np.dtype("<f4"),  # storage only: the assembly reads these values into float64
    ord("d"): LOGPROB_DTYPE.newbyteorder("<"),
}
"""The numpy type of each tag's values (keyed by the tag byte, as ``blob[0]`` gives it): the in-memory
types of ``tracegym.arrays``, little-endian."""


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
    """The blob's values as an ``array`` of its own type (``i``/``q``/``f``/``d``); None stays None. A step on
    the way from a blob to a list (``decode``) or to another blob (``widen_ids``), and a blob's check; no
    in-memory form (that is numpy): ``array.tolist()`` makes the list faster than numpy's (most for
    floats). (``array(tag, blob[1:])`` is one C call, cheaper than an empty array plus ``frombytes`` of a
    memoryview slice.)"""
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


ITEMSIZE: dict[int, int] = {ord("i"): 4, ord("q"): 8, ord("f"): 4, ord("d"): 8}
"""Bytes per value of each tag (keyed by the tag byte, as ``blob[0]`` gives it)."""
ID_TAGS = frozenset((ord("i"), ord("q")))
FLOAT_TAGS = frozenset((ord("f"), ord("d")))


def blob_length(blob: bytes, tags: frozenset[int] = ID_TAGS) -> int:
    """How many values ``blob`` holds; ValueError unless it is a well-formed blob with one of ``tags``.
    The assembly works on blobs as they are (two blobs of one tag hold equal values exactly when their
    bytes are equal, so prefixes compare with ``bytes.startswith``); this is their check."""
    n = blob_count(blob, tags)
    if n >= 0:
        return n
    if not blob:
        raise ValueError("token array blob is empty")
    if blob[0] not in tags:
        raise ValueError(f"token array blob has tag {chr(blob[0])!r}, expected one of "
                         f"{', '.join(sorted(chr(t) for t in tags))}")
    raise ValueError(f"token array blob of {len(blob) - 1} bytes is not a whole number of "
                     f"{chr(blob[0])!r} values")


def blob_count(blob: bytes, tags: frozenset[int] = ID_TAGS) -> int:
    """``blob_length`` without the exception: -1 for a malformed blob (the read path's quick check)."""
    if not blob or blob[0] not in tags:
        return -1
    n, rest = divmod(len(blob) - 1, ITEMSIZE[blob[0]])
    return -1 if rest else n


def split_blob(blob: bytes | None, counts: list[int | None],
               tags: frozenset[int] = ID_TAGS) -> list[bytes | None]:
    """``blob`` (the concatenated values of several choices) cut into one blob per count, in order (None:
    that choice has no array). ValueError when the blob is malformed or holds fewer values than the counts
    add up to. The common single count equal to the blob's length returns ``blob`` itself (no copy)."""
    if blob is None:
        if any(n is not None for n in counts):
            raise ValueError("stored token array is shorter than the choices' lengths")
        return [None] * len(counts)
    total = blob_length(blob, tags)
    if len(counts) == 1 and counts[0] == total:
        return [blob]
    tag, size = blob[:1], ITEMSIZE[blob[0]]
    out: list[bytes | None] = []
    pos = 1
    for n in counts:
        if n is None:
            out.append(None)
            continue
        stop = pos + n * size
        if n < 0 or stop > len(blob):
            raise ValueError("stored token array is shorter than the choices' lengths")
        out.append(tag + blob[pos:stop])
        pos = stop
    return out


_TAG_OF = {(dt.kind, dt.itemsize): bytes((tag,)) for tag, dt in DTYPES.items()}


def array_blob(values: Sequence[int] | Sequence[float] | np.ndarray, floats: bool = False) -> bytes:
    """The blob of a list or a numpy array (``encode_ints`` / ``encode_floats`` for lists; an int32/int64
    or float32/float64 array keeps its own type, copied as bytes)."""
    if isinstance(values, np.ndarray) and values.dtype.kind == ("f" if floats else "i") and values.ndim == 1:
        tag = _TAG_OF.get((values.dtype.kind, values.dtype.itemsize))
        if tag is not None:
            return tag + values.astype(DTYPES[tag[0]], copy=False).tobytes()
    return encode_floats(values) if floats else encode_ints(values)  # type: ignore[arg-type]


def widen_ids(blob: bytes) -> bytes:
    """An ``i`` (int32) id blob as the ``q`` (int64) blob of the same values; a ``q`` blob as it is."""
    if blob[0] == ord("q"):
        return blob
    values = decode_array(blob)
    return b"q" + _packer("q", len(values)).pack(*values)  # type: ignore[arg-type]
