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
from typing import Any

import numpy as np

from tracegym.gateway.assembly_calls import (
    DTYPES,
    TokenCall,
    TokenChoice,
    count,
    payload,
    token_calls,
    values,
)
from tracegym.gateway.store.codec import ITEMSIZE, decode
from tracegym.types import CallRecord, Sequence, Trajectory

Choices = dict[tuple[str, int], tuple[TokenCall, TokenChoice]]


class InvariantError(AssertionError):
    """An assembled trajectory breaks one of its promises; the message says where."""


def _choices(calls: list[TokenCall]) -> Choices:
    out: Choices = {}
    for call in calls:
        for choice in call.choices:
            key = (call.call_id, choice.index)
            if key in out:
                raise InvariantError(f"call {call.call_id} choice {choice.index} appears twice in the calls")
            out[key] = (call, choice)
    return out


def _check_sequence(si: int, seq: Sequence, choices: Choices) -> list[tuple[str, int]]:
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
        prompt, out = decode(call.prompt) or [], decode(choice.output) or []
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
        engine = decode(choice.logprobs)
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


def _ids_bytes(ids: Any, tag: int) -> bytes | None:
    """The sequence's ids packed as values of the blob tag ``tag`` (numpy arrays or lists), or None when
    one does not fit that type (then no blob of that tag can match them)."""
    dtype = DTYPES[tag]
    if isinstance(ids, np.ndarray):
        if ids.dtype == dtype:  # as assembled
            return ids.tobytes()
        if ids.dtype.kind not in "iu" or (ids.size and not (np.iinfo(dtype).min <= ids.min()
                                                            and ids.max() <= np.iinfo(dtype).max)):
            return None
        return ids.astype(dtype).tobytes()
    try:
        return struct.pack(f"<{len(ids)}{chr(tag)}", *ids)
    except struct.error:  # an id outside this type's range, or not an int
        return None


def _trained(seq: Sequence, choices: Choices) -> list[tuple[TokenCall, TokenChoice]] | None:
    """The (call, choice) of each entry of ``seq.call_ids`` / ``choice_indices``; None if one is unknown."""
    out = []
    for key in zip(seq.call_ids, seq.choice_indices, strict=True):
        found = choices.get(key)
        if found is None:
            return None
        out.append(found)
    return out


def _sequence_ok(seq: Sequence, choices: Choices) -> bool:
    """True when ``seq`` keeps every promise ``_check_sequence`` verifies, checked at C speed: each call's
    prompt and output ids compared as bytes (``memcmp``) at their offsets in the sequence's ids packed as
    the blobs' type; the mask, as bytes, against the one the calls imply; the logprobs, bit for bit, against
    the engine's on the sampled tokens and NaN elsewhere. Never True for a sequence ``_check_sequence``
    rejects; False defers to it for the message (and for retokenized sequences, which it alone checks)."""
    if seq.retokenized or not seq.call_ids or len(seq.call_ids) != len(seq.choice_indices):
        return False
    ids, mask, lps = seq.packed()
    n = len(ids)
    if len(mask) != n or len(lps) != n:
        return False
    trained = _trained(seq, choices)
    if trained is None or trained[0][0].prompt is None:
        return False
    tag = trained[0][0].prompt[0]  # one id type per rollout (token_calls)
    raw = _ids_bytes(ids, tag)
    if raw is None:
        return False
    size = ITEMSIZE[tag]
    expected_mask = bytearray(n)
    engine_blobs: list[bytes] = []
    prev_end = 0
    for call, choice in trained:
        prompt, out, engine = call.prompt, choice.output, choice.logprobs
        if prompt is None or out is None or engine is None:
            return False
        start = count(prompt)
        end = start + count(out)
        if start < prev_end or end > n or count(engine) != end - start:
            return False
        if not (raw.startswith(payload(prompt)) and raw.startswith(payload(out), start * size)):
            return False
        expected_mask[start:end] = b"\x01" * (end - start)
        engine_blobs.append(engine)
        prev_end = end
    return prev_end == n and _mask_ok(mask, expected_mask) and _logprobs_ok(lps, expected_mask, engine_blobs)


def _mask_ok(mask: Any, expected: bytearray) -> bool:
    """The sequence's mask (packed or a list) is ``expected`` (one 0/1 byte per token)."""
    if isinstance(mask, np.ndarray):
        if mask.dtype == np.int8:  # as assembled
            return mask.tobytes() == expected
        return mask.dtype.kind in "iu" and np.array_equal(mask, np.frombuffer(expected, dtype=np.int8))
    return mask == list(expected)


def _logprobs_ok(lps: Any, mask: bytearray, engine: list[bytes]) -> bool:
    """The sequence's logprobs are the engine's (``engine``: the trained outputs' blobs, in order) where
    ``mask`` is 1 and NaN (None) elsewhere. Packed float64 logprobs are compared bit for bit with the NaN
    the assembly writes (another NaN, or a -0.0 for 0.0, defers to the list check)."""
    expected = np.full(len(mask), np.nan)
    expected[np.frombuffer(mask, dtype=np.bool_)] = np.concatenate([values(b) for b in engine])
    if isinstance(lps, np.ndarray):
        return lps.dtype == np.float64 and lps.tobytes() == expected.tobytes()
    return lps == [None if x != x else x for x in expected.tolist()]


def check_invariants(calls: list[CallRecord] | list[TokenCall], trajectory: Trajectory) -> None:
    """Raise ``InvariantError`` with a precise message if ``trajectory`` breaks a promise about ``calls``
    (``CallRecord``s or ``TokenCall``s)."""
    choices = _choices(token_calls(calls))
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
