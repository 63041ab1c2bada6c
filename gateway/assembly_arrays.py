"""Token ids and logprobs as numpy arrays: views of the store's ``array.array``s (no copy), or converted
from lists. What packed sequences are built from and checked against."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np


def _as_numpy(values: Any, dtype: type) -> np.ndarray:
    """A view of an ``array.array`` (its own type), else ``values`` converted to ``dtype``."""
    if isinstance(values, array):
        return np.frombuffer(values, dtype=values.typecode)
    return np.asarray(values, dtype=dtype)


def ids_array(values: Any) -> np.ndarray:
    """Token ids as a numpy array (int64 from a list)."""
    return _as_numpy(values, np.int64)


def logprobs_array(values: Any) -> np.ndarray:
    """Engine logprobs as a numpy array (float32/64 from the store, float64 from a list)."""
    return _as_numpy(values, np.float64)
