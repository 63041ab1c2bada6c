"""``tracegym.arrays``: the one in-memory form of token arrays (numpy, fixed dtypes), and ``Sequence.arrays``."""

from __future__ import annotations

import json
import subprocess
import sys
from array import array

import numpy as np
import pytest

from tracegym.arrays import (
    LOGPROB_DTYPE,
    LOSS_MASK_DTYPE,
    TOKEN_ID_DTYPE,
    TokenArrays,
    as_logprobs,
    as_loss_mask,
    as_token_ids,
    token_arrays,
)
from tracegym.types import Sequence, Trajectory


def test_lists_become_the_fixed_dtypes() -> None:
    got = token_arrays([1, 2, 3], [0, 1, True], [None, -0.5, 0])
    assert isinstance(got, TokenArrays)
    assert (got.token_ids.dtype, got.loss_mask.dtype, got.logprobs.dtype) == (np.int64, np.int8, np.float64)
    assert got.token_ids.dtype == TOKEN_ID_DTYPE and got.loss_mask.dtype == LOSS_MASK_DTYPE
    assert got.logprobs.dtype == LOGPROB_DTYPE
    assert got.token_ids.tolist() == [1, 2, 3] and got.loss_mask.tolist() == [0, 1, 1]
    assert np.isnan(got.logprobs[0]) and got.logprobs[1:].tolist() == [-0.5, 0.0]  # None -> NaN


def test_empty_lists_and_other_sequences() -> None:
    empty = token_arrays([], [], [])
    assert [a.dtype for a in empty] == [np.int64, np.int8, np.float64] and all(len(a) == 0 for a in empty)
    assert as_token_ids((4, 5)).tolist() == [4, 5] and as_token_ids(range(3)).tolist() == [0, 1, 2]
    assert as_token_ids(array("i", [7, 8])).dtype == np.int32  # a typed buffer keeps its width
    assert as_token_ids([2**63 - 1]).tolist() == [2**63 - 1] and as_token_ids([-1]).tolist() == [-1]


def test_arrays_of_the_types_are_kept_and_others_converted() -> None:
    ids32, ids64 = np.array([1, 2], dtype=np.int32), np.array([1, 2], dtype=np.int64)
    mask, lps = np.array([0, 1], dtype=np.int8), np.array([np.nan, -1.0])
    assert as_token_ids(ids32) is ids32 and as_token_ids(ids64) is ids64  # the assembly's int32 stays
    assert as_loss_mask(mask) is mask and as_logprobs(lps) is lps
    assert as_token_ids(np.array([1, 2], dtype=np.uint16)).dtype == np.int64
    assert as_token_ids(np.array([1, 2], dtype=np.uint64)).dtype == np.int64
    assert as_loss_mask(np.array([True, False])).tolist() == [1, 0]
    assert as_loss_mask(np.array([0, 1], dtype=np.int64)).dtype == np.int8
    assert as_logprobs(np.array([-0.5], dtype=np.float32)).dtype == np.float64
    assert np.isnan(as_logprobs(np.array([None, -0.5], dtype=object))[0])


@pytest.mark.parametrize(
    ("convert", "value", "message"),
    [
        (as_token_ids, [1.5], "token_ids must be integers within int64, got float64"),
        (as_token_ids, [1, None], "token_ids must be integers within int64"),
        (as_token_ids, ["1"], "token_ids must be integers within int64"),
        (as_token_ids, [True, False], "token_ids must be integers within int64, got bool"),
        (as_token_ids, [2**63], "token_ids must be integers within int64"),
        (as_token_ids, [2**70], "token_ids must be integers within int64"),
        (as_token_ids, np.array([2**63], dtype=np.uint64), "token_ids must be integers within int64"),
        (as_token_ids, [[1, 2]], r"one dimension; got shape \(1, 2\)"),
        (as_token_ids, 5, r"one dimension; got shape \(\)"),
        (as_token_ids, [[1], [2, 3]], "token_ids must be integers within int64: "),
        (as_loss_mask, [0, 2], "loss_mask must hold 0 or 1, got 2 at position 1"),
        (as_loss_mask, [-1], "loss_mask must hold 0 or 1, got -1 at position 0"),
        (as_loss_mask, np.array([0, 3], dtype=np.int8), "got 3 at position 1"),
        (as_loss_mask, [0.0, 1.0], "loss_mask must hold 0 or 1, got float64"),
        (as_loss_mask, [None], "loss_mask must hold 0 or 1"),
        (as_logprobs, ["x"], "logprobs must be numbers or None"),
        (as_logprobs, [{}], "logprobs must be numbers or None"),
        (as_logprobs, np.array(["x"]), "logprobs must be numbers or None"),
        (as_logprobs, np.array([True]), "logprobs must be numbers or None, got bool"),
        (as_logprobs, [[-1.0]], "one dimension"),
    ],
)
def test_bad_values_are_clear_value_errors(convert, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        convert(value)


def test_lengths_must_agree() -> None:
    with pytest.raises(ValueError, match="token_ids, loss_mask and logprobs must have the same length, got 2, 2, 1"):
        token_arrays([1, 2], [0, 1], [None])


def test_sequence_arrays_of_lists_and_of_arrays() -> None:
    """A list-built sequence converts on each call (the lists stay what it holds and reads); one built from
    arrays of the types hands them out as they are. Either way the values agree with the public lists."""
    listed = Sequence([1, 2, 3], [0, 1, 1], [None, -0.5, -0.25])
    got = listed.arrays()
    assert got.token_ids.dtype == np.int64 and np.isnan(got.logprobs[0])
    assert type(listed.token_ids) is list and listed.arrays().token_ids is not got.token_ids
    listed.token_ids[2] = 9  # the list is still the sequence's: a later call sees the edit
    assert listed.arrays().token_ids.tolist() == [1, 2, 9]
    held = Sequence(np.array([1, 2, 9], dtype=np.int32), np.array([0, 1, 1], dtype=np.int8),
                    np.array([np.nan, -0.5, -0.25]))
    assert all(a is b for a, b in zip(held.arrays(), held.arrays(), strict=True))
    assert held == listed and held.logprobs == [None, -0.5, -0.25]
    for a, b in zip(held.arrays(), listed.arrays(), strict=True):
        np.testing.assert_array_equal(a, b)
    parsed = Trajectory.from_dict(json.loads(json.dumps(Trajectory("r", None, None, [held]).to_dict())))
    for a, b in zip(parsed.sequences[0].arrays(), held.arrays(), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="same length"):
        Sequence([1, 2], [0, 1], [None]).arrays()


def test_sequence_from_arrays_hands_them_out_until_a_field_changes() -> None:
    arrays = token_arrays(np.array([4, 5], dtype=np.int32), [0, 1], [None, -0.5])
    seq = Sequence.from_arrays(arrays, "agent", ["v1"])
    assert seq.arrays() is arrays and seq.agent_name == "agent" and seq.weight_versions == ["v1"]
    assert seq.token_ids == [4, 5] and seq.logprobs == [None, -0.5]  # lists made on read, as before
    assert seq.arrays() is not arrays and seq.arrays().token_ids.tolist() == [4, 5]  # from the lists now
    seq.loss_mask = np.array([0, 2], dtype=np.int8)  # a field replaced: checked again
    with pytest.raises(ValueError, match="loss_mask must hold 0 or 1, got 2 at position 1"):
        seq.arrays()


def test_import_tracegym_and_reading_sequences_load_no_numpy() -> None:
    """numpy is no SDK dependency: only ``Sequence.arrays`` loads it (checked in a fresh interpreter)."""
    probe = ("import sys, tracegym, tracegym.types as t\n"
             "s = t.Sequence([1, 2], [0, 1], [None, -0.5]); s.to_dict(); s.token_ids; s == s\n"
             "print('numpy' in sys.modules, 'tracegym.arrays' in sys.modules)\n"
             "s.arrays()\n"
             "print('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True"]
