"""``check_invariants``: the promises of an assembled trajectory, verified against its calls.

For every sequence: ``token_ids``, ``loss_mask`` and ``logprobs`` have one length; for each trained call
choice listed on it, the sequence starts with that call's exact prompt ids and continues with the
choice's exact output ids at the next position; mask is 1 exactly on those output positions (so no
prompt, tool or user token is trained) and the sequence ends with its last output; logprobs are the
engine's there and None elsewhere (a ``retokenized`` sequence may carry None on sampled tokens). Across
the trajectory every call choice is trained exactly once or listed in ``excluded``, never both.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any

import numpy as np

from tracegym.gateway.assembly_arrays import ids_array, logprobs_array
from tracegym.types import CallRecord, ChoiceRecord, Sequence, Trajectory


class InvariantError(AssertionError):
    """An assembled trajectory breaks one of its promises; the message says where."""


def _as_list(values: Any) -> list:
    """Ids or logprobs as a list (records may carry ``array.array``s); None stays None."""
    if values is None or isinstance(values, list):
        return values
    return values.tolist() if isinstance(values, array) else list(values)


def _choices(calls: list[CallRecord]) -> dict[tuple[str, int], tuple[CallRecord, ChoiceRecord]]:
    out: dict[tuple[str, int], tuple[CallRecord, ChoiceRecord]] = {}
    for call in calls:
        for choice in call.choices:
            key = (call.call_id, choice.index)
            if key in out:
                raise InvariantError(f"call {call.call_id} choice {choice.index} appears twice in the calls")
            out[key] = (call, choice)
    return out


def _check_sequence(
    si: int, seq: Sequence, choices: dict[tuple[str, int], tuple[CallRecord, ChoiceRecord]]
) -> list[tuple[str, int]]:
    n = len(seq.token_ids)
    if len(seq.loss_mask) != n or len(seq.logprobs) != n:
        raise InvariantError(
            f"sequence {si}: {n} token_ids, {len(seq.loss_mask)} loss_mask, {len(seq.logprobs)} logprobs"
        )
    if not seq.call_ids or len(seq.call_ids) != len(seq.choice_indices):
        raise InvariantError(
            f"sequence {si}: call_ids {seq.call_ids!r} and choice_indices {seq.choice_indices!r} "
            "must be non-empty and aligned"
        )
    expected = [0] * n
    nones: list[None] = [None] * n
    prev_end = 0
    keys = list(zip(seq.call_ids, seq.choice_indices, strict=True))
    for call_id, k in keys:
        if (call_id, k) not in choices:
            raise InvariantError(f"sequence {si}: unknown call choice {call_id} #{k}")
        call, choice = choices[(call_id, k)]
        prompt, out = _as_list(call.prompt_ids) or [], _as_list(choice.output_ids) or []
        start, end = len(prompt), len(prompt) + len(out)
        where = f"sequence {si}, call {call_id} choice {k}"
        if start < prev_end:
            raise InvariantError(
                f"{where}: prompt ({start} ids) ends inside the previous output (at {prev_end})"
            )
        if end > n or seq.token_ids[:start] != prompt:
            raise InvariantError(f"{where}: the sequence does not start with the call's {start} prompt ids")
        if seq.token_ids[start:end] != out:
            raise InvariantError(f"{where}: output ids not found at positions [{start}, {end})")
        lps = seq.logprobs[start:end]
        engine = _as_list(choice.output_logprobs)
        if not seq.retokenized and lps != engine:
            raise InvariantError(f"{where}: logprobs differ from the engine's on the sampled tokens")
        if seq.retokenized and any(
            lp is not None and (engine is None or lp != engine[i]) for i, lp in enumerate(lps)
        ):
            raise InvariantError(
                f"{where}: a retokenized sequence carries logprobs the engine did not return"
            )
        if seq.logprobs[prev_end:start] != nones[: start - prev_end]:
            i = next(j for j in range(prev_end, start) if seq.logprobs[j] is not None)
            raise InvariantError(f"sequence {si}: position {i} has mask 0 but logprob {seq.logprobs[i]!r}")
        expected[start:end] = [1] * len(out)
        prev_end = end
    if prev_end != n:
        raise InvariantError(f"sequence {si}: {n - prev_end} trailing tokens after the last sampled output")
    if seq.loss_mask != expected:
        i = next(j for j in range(n) if seq.loss_mask[j] != expected[j])
        what = "a sampled token" if expected[i] else "a prompt/tool token"
        raise InvariantError(
            f"sequence {si}: position {i} (id {seq.token_ids[i]}) is {what} but has mask {seq.loss_mask[i]!r}"
        )
    return keys


class _Packed:
    """A sequence's token ids as machine integers, packed once per array type on first use, so the
    prompts and outputs of array records are compared as bytes (``memcmp``, no slice copies), not int by
    int."""

    def __init__(self, ids: list) -> None:
        self.ids = ids
        self._by_type: dict[str, bytes | None] = {}

    def equal(self, values: Any, start: int, end: int) -> bool:
        """``ids[start:end] == values`` (``values`` a list or an ``array``; None only if empty)."""
        if not isinstance(values, array) or values.typecode not in "iq":
            return self.ids[start:end] == (values if values is not None else [])
        tc = values.typecode
        if tc not in self._by_type:
            try:
                self._by_type[tc] = struct.pack(f"{len(self.ids)}{tc}", *self.ids)
            except struct.error:  # an id outside this type's range (or not an int): compare as lists
                self._by_type[tc] = None
        packed = self._by_type[tc]
        if packed is None:
            return self.ids[start:end] == values.tolist()
        return len(values) == end - start and packed.startswith(values.tobytes(), start * values.itemsize)


def _trained(seq: Sequence, choices: dict[tuple[str, int], tuple[CallRecord, ChoiceRecord]]
             ) -> list[tuple[CallRecord, ChoiceRecord]] | None:
    """The (call, choice) of each entry of ``seq.call_ids`` / ``choice_indices``; None if one is unknown."""
    out = []
    for key in zip(seq.call_ids, seq.choice_indices, strict=True):
        found = choices.get(key)
        if found is None:
            return None
        out.append(found)
    return out


def _packed_ok(seq: Sequence, choices: dict[tuple[str, int], tuple[CallRecord, ChoiceRecord]]) -> bool:
    """``_sequence_ok`` for a sequence holding numpy arrays (as assembled): the ids compared as bytes
    (``memcmp`` of each call's prompt and output at their offsets), the mask and logprobs whole against
    the ones the calls imply (NaN where None)."""
    ids, mask, lps = seq.packed()
    n = len(ids)
    if not (isinstance(mask, np.ndarray) and isinstance(lps, np.ndarray)) or len(mask) != n or len(lps) != n:
        return False
    if mask.dtype.kind not in "iu" or lps.dtype != np.float64 or ids.dtype.kind not in "iu":
        return False
    raw = ids.tobytes()
    size = ids.itemsize
    expected_mask = np.zeros(n, dtype=np.int8)
    expected_lps = np.full(n, np.nan)
    trained = _trained(seq, choices)
    if trained is None:
        return False
    prev_end = 0
    for call, choice in trained:
        engine = choice.output_logprobs
        if call.prompt_ids is None or choice.output_ids is None or engine is None:
            return False
        prompt, out = ids_array(call.prompt_ids), ids_array(choice.output_ids)
        start = len(prompt)
        end = start + len(out)
        if start < prev_end or end > n or len(engine) != end - start:
            return False
        if prompt.dtype == ids.dtype and out.dtype == ids.dtype:
            if not (raw.startswith(prompt, 0) and raw.startswith(out, start * size)):
                return False
        elif not (np.array_equal(ids[:start], prompt) and np.array_equal(ids[start:end], out)):
            return False
        expected_mask[start:end] = 1
        expected_lps[start:end] = logprobs_array(engine)
        prev_end = end
    return (prev_end == n and np.array_equal(mask, expected_mask)
            and np.array_equal(lps, expected_lps, equal_nan=True))


def _sequence_ok(seq: Sequence, choices: dict[tuple[str, int], tuple[CallRecord, ChoiceRecord]]) -> bool:
    """True when ``seq`` keeps every promise ``_check_sequence`` verifies, checked at C speed: ids slice
    by slice as bytes, then the whole mask and logprobs against the ones the calls imply. Never True for
    a sequence ``_check_sequence`` rejects; False defers to it for the message (and for retokenized
    sequences, which it alone checks)."""
    if seq.retokenized or not seq.call_ids or len(seq.call_ids) != len(seq.choice_indices):
        return False
    if isinstance(seq.packed()[0], np.ndarray):
        return _packed_ok(seq, choices)
    n = len(seq.token_ids)
    if len(seq.loss_mask) != n or len(seq.logprobs) != n:
        return False
    ids = _Packed(seq.token_ids)
    mask: list[int] = [0] * n
    lps: list[float | None] = [None] * n
    trained = _trained(seq, choices)
    if trained is None:
        return False
    prev_end = 0
    for call, choice in trained:
        prompt, out = call.prompt_ids, choice.output_ids
        start = len(prompt) if prompt is not None else 0
        end = start + (len(out) if out is not None else 0)
        if start < prev_end or end > n or not ids.equal(prompt, 0, start) or not ids.equal(out, start, end):
            return False
        engine = _as_list(choice.output_logprobs)
        if engine is None or len(engine) != end - start:
            return False
        mask[start:end] = [1] * (end - start)
        lps[start:end] = engine
        prev_end = end
    return prev_end == n and seq.loss_mask == mask and seq.logprobs == lps


def check_invariants(calls: list[CallRecord], trajectory: Trajectory) -> None:
    """Raise ``InvariantError`` with a precise message if ``trajectory`` breaks a promise about ``calls``."""
    choices = _choices(calls)
    trained: dict[tuple[str, int], int] = {}
    for si, seq in enumerate(trajectory.sequences):
        if _sequence_ok(seq, choices):
            keys = list(zip(seq.call_ids, seq.choice_indices, strict=True))
        else:
            keys = _check_sequence(si, seq, choices)  # raises with the precise message (or passes)
        for key in keys:
            if key in trained:
                raise InvariantError(
                    f"call {key[0]} choice {key[1]} is trained twice (sequences {trained[key]} and {si})"
                )
            trained[key] = si
    excluded: set[tuple[str, int]] = set()
    for ex in trajectory.excluded:
        key = (ex["call_id"], ex["choice_index"])
        if key in trained:
            raise InvariantError(
                f"call {key[0]} choice {key[1]} is both trained and excluded ({ex['reason']})"
            )
        excluded.add(key)
    missing = [k for k in choices if k not in trained and k not in excluded]
    if missing:
        raise InvariantError(f"call choices neither trained nor excluded: {missing[:5]!r}")
