"""Token ids and logprobs as numpy arrays: views of the store's ``array.array``s (no copy), or converted
from lists. What packed sequences are built from and checked against."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np


def ids_array(values: Any) -> np.ndarray:
    """Token ids as a numpy array: a view of an ``array.array`` (its own integer type), else int64."""
    if isinstance(values, array):
        return np.frombuffer(values, dtype=values.typecode)
    return np.asarray(values, dtype=np.int64)


def logprobs_array(values: Any) -> np.ndarray:
    """Engine logprobs as a numpy array: a view of an ``array.array`` (float32/64), else float64."""
    if isinstance(values, array):
        return np.frombuffer(values, dtype=values.typecode)
    return np.asarray(values, dtype=np.float64)
