"""The one in-memory form of a sequence's token arrays: numpy arrays of fixed dtypes.

Wherever the gateway and the trainer work on token ids, a loss mask or logprobs, they hold them as
``TokenArrays``:

- ``token_ids``: integers, int64 when converted here, or int32: the assembly keeps the width of the
  store's blobs (int32 when every id of the rollout fits), so ids are one of ``TOKEN_ID_DTYPES``;
- ``loss_mask``: ``LOSS_MASK_DTYPE`` (int8), 0 or 1;
- ``logprobs``: ``LOGPROB_DTYPE`` (float64), NaN where there is no logprob.

Two other forms exist, each at a boundary: lists in the public SDK types and in JSON (``Sequence.token_ids``,
``loss_mask``, ``logprobs``; None for a missing logprob), and the tagged little-endian blobs the store keeps
(``tracegym.gateway.traces.codec``).

numpy is no dependency of the bare SDK: nothing that ``import tracegym`` loads imports this module
(``Sequence.arrays`` imports it when called; the gateway and trainer extras bring numpy).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

TOKEN_ID_DTYPE = np.dtype(np.int64)
"""The dtype of ids converted from Python values (lists, other integer types)."""
TOKEN_ID_DTYPES = (np.dtype(np.int32), TOKEN_ID_DTYPE)
"""The dtypes token ids are held in: kept as they are (int32 from the assembly of int32 blobs)."""
LOSS_MASK_DTYPE = np.dtype(np.int8)
LOGPROB_DTYPE = np.dtype(np.float64)

_INT64_MAX = np.iinfo(np.int64).max


class TokenArrays(NamedTuple):
    """A sequence's arrays, all of one length (``token_arrays`` makes them)."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray


def token_arrays(token_ids: Any, loss_mask: Any, logprobs: Any) -> TokenArrays:
    """The three as ``TokenArrays`` (``as_token_ids``, ``as_loss_mask``, ``as_logprobs``); ValueError when
    one cannot be converted or their lengths differ."""
    out = TokenArrays(as_token_ids(token_ids), as_loss_mask(loss_mask), as_logprobs(logprobs))
    n = len(out.token_ids)
    if len(out.loss_mask) != n or len(out.logprobs) != n:
        raise ValueError(f"token_ids, loss_mask and logprobs must have the same length, got "
                         f"{n}, {len(out.loss_mask)}, {len(out.logprobs)}")
    return out


_IDS = "token_ids must be integers within int64"
_MASK = "loss_mask must hold 0 or 1"
_LOGPROBS = "logprobs must be numbers or None"


def as_token_ids(values: Any) -> np.ndarray:
    """``values`` (a list, any sequence of integers, or an ndarray) as a 1-D id array: an int32 or int64
    ndarray as it is (not copied), anything else as int64. ValueError for values that are not integers
    within int64 (floats, bools, None, strings)."""
    a = _one_dim(values, None, _IDS)
    if a.dtype in TOKEN_ID_DTYPES:
        return a
    if a.size == 0:  # an empty list has no type of its own (numpy makes it float64)
        return np.empty(0, TOKEN_ID_DTYPE)
    if a.dtype.kind == "i" or (a.dtype.kind == "u" and (a.dtype.itemsize < 8 or a.max() <= _INT64_MAX)):
        return a.astype(TOKEN_ID_DTYPE)
    raise ValueError(f"{_IDS}, got {_what(a)}")


def as_loss_mask(values: Any) -> np.ndarray:
    """``values`` as a 1-D int8 array of 0s and 1s (an int8 ndarray is not copied; bools are taken).
    ValueError for any other value."""
    a = _one_dim(values, None, _MASK)
    if a.size == 0:
        return a if a.dtype == LOSS_MASK_DTYPE else np.empty(0, LOSS_MASK_DTYPE)
    if a.dtype == LOSS_MASK_DTYPE and a.view(np.uint8).max() <= 1:  # as uint8, a negative value is > 1 too
        return a
    if a.dtype.kind == "b":
        return a.astype(LOSS_MASK_DTYPE)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{_MASK}, got {_what(a)}")
    if (a.dtype.kind == "i" and a.min() < 0) or a.max() > 1:
        i = int(np.flatnonzero((a < 0) | (a > 1))[0])
        raise ValueError(f"{_MASK}, got {a[i].item()} at position {i}")
    return a if a.dtype == LOSS_MASK_DTYPE else a.astype(LOSS_MASK_DTYPE)


def as_logprobs(values: Any) -> np.ndarray:
    """``values`` as a 1-D float64 array, None as NaN (a float64 ndarray is not copied). ValueError for
    values that are not numbers or None."""
    # Python values go straight to float64 (None becomes NaN there); an ndarray keeps its type to be checked.
    a = _one_dim(values, None if isinstance(values, np.ndarray) else LOGPROB_DTYPE, _LOGPROBS)
    if a.dtype == LOGPROB_DTYPE:
        return a
    if a.dtype.kind in "fiuO":  # an object array: None among numbers
        try:
            return a.astype(LOGPROB_DTYPE)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{_LOGPROBS}: {e}") from None
    raise ValueError(f"{_LOGPROBS}, got {_what(a)}")


def _one_dim(values: Any, dtype: np.dtype | None, rule: str) -> np.ndarray:
    """``values`` as an ndarray (of ``dtype``, or of the type numpy finds), which must be 1-D; ``rule``
    starts the message of the ValueError."""
    if not isinstance(values, np.ndarray):
        try:
            values = np.array(values, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"{rule}: {e}") from None
    if values.ndim != 1:
        raise ValueError(f"{rule}, in one dimension; got shape {values.shape}")
    return values


def _what(a: np.ndarray) -> str:
    return "None, mixed types or integers beyond int64" if a.dtype.kind == "O" else f"{a.dtype} values"
