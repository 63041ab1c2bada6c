"""``check_invariants``: the promises of an assembled trajectory, verified against its calls.

For every sequence: ``token_ids``, ``loss_mask`` and ``logprobs`` have one length; for each trained call
choice listed on it, the sequence starts with that call's exact prompt ids and continues with the
choice's exact output ids at the next position; mask is 1 exactly on those output positions (so no
prompt, tool or user token is trained) and the sequence ends with its last output; logprobs are the
engine's there and None elsewhere (a ``retokenized`` sequence may carry None on sampled tokens). Across
the trajectory every call choice is trained exactly once or listed in ``excluded``, never both.

Each promise is checked on whole buffers (the sequence's ``arrays()``, ids as the blobs' bytes); only when
one fails is the first offending position located, for the message.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tracegym.arrays import LOGPROB_DTYPE
from tracegym.gateway.traces.codec import DTYPES, ITEMSIZE
from tracegym.gateway.traces.token_calls import (
    TokenCall,
    TokenChoice,
    count,
    payload,
    token_calls,
    values,
)
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


def _ids_bytes(ids: np.ndarray, tag: int) -> bytes:
    """The sequence's ids packed as values of the id blob tag ``tag``, up to the first id out of that type's
    range: no blob of that tag matches that position, and a comparison reaching it finds the buffer too
    short."""
    dtype = DTYPES[tag]
    if ids.dtype == dtype:  # as assembled
        return ids.tobytes()
    info = np.iinfo(dtype)
    bad = np.flatnonzero((ids < info.min) | (ids > info.max))
    return ids[: bad[0] if len(bad) else len(ids)].astype(dtype).tobytes()


def _at(values: np.ndarray, i: int) -> Any:
    """``values[i]`` as a plain Python value (for messages)."""
    return values[i].item()


def _where(si: int, call_id: str, k: int) -> str:
    return f"sequence {si}, call {call_id} choice {k}"


def _check_mask(si: int, ids: np.ndarray, mask: np.ndarray, expected: bytearray) -> None:
    """The sequence's mask (int8) is ``expected`` (one 0/1 byte per token)."""
    if mask.tobytes() == expected:
        return
    i = int((mask != np.frombuffer(expected, dtype=mask.dtype)).argmax())
    what = "a sampled token" if expected[i] else "a prompt/tool token"
    raise InvariantError(
        f"sequence {si}: position {i} (id {_at(ids, i)}) is {what} but has mask {_at(mask, i)!r}"
    )


def _check_logprobs(si: int, seq: Sequence, got: np.ndarray, expected: np.ndarray, sampled: bytearray,
                    spans: list[tuple[int, str, int]]) -> None:
    """The sequence's logprobs (float64) are ``expected`` (the engine's, NaN for None), compared as values;
    in a retokenized sequence a sampled position may be None instead. ``spans``: (end, call_id, choice
    index) of each trained output, to name the call at fault."""
    if not seq.retokenized and got.tobytes() == expected.tobytes():
        return
    good = got == expected
    good |= np.isnan(got) if seq.retokenized else np.isnan(got) & np.isnan(expected)
    if good.all():
        return
    i = int(good.argmin())
    if not sampled[i]:
        raise InvariantError(f"sequence {si}: position {i} has mask 0 but logprob {got[i].item()!r}")
    where = next(_where(si, call_id, k) for end, call_id, k in spans if i < end)
    if seq.retokenized:
        raise InvariantError(f"{where}: a retokenized sequence carries logprobs the engine did not return "
                             f"(position {i})")
    raise InvariantError(f"{where}: logprobs differ from the engine's on the sampled tokens (position {i})")


def _check_sequence(si: int, seq: Sequence, choices: Choices) -> list[tuple[str, int]]:
    """The (call_id, choice index) trained by ``seq``, once it is verified against their calls."""
    try:
        ids, mask, lps = seq.arrays()
    except ValueError as e:  # values that are no token arrays, or lengths that differ
        raise InvariantError(f"sequence {si}: {e}") from None
    n = len(ids)
    if not seq.call_ids or len(seq.call_ids) != len(seq.choice_indices):
        raise InvariantError(
            f"sequence {si}: call_ids {seq.call_ids!r} and choice_indices {seq.choice_indices!r} "
            "must be non-empty and aligned"
        )
    keys = list(zip(seq.call_ids, seq.choice_indices, strict=True))
    packed: dict[int, bytes] = {}  # the ids as bytes, per blob tag (one per rollout, see token_calls)
    sampled = bytearray(n)
    engine: list[bytes] = []
    # the positions the engine's logprobs fill: all sampled ones, unless the sequence is retokenized
    covered = bytearray(n) if seq.retokenized else sampled
    spans: list[tuple[int, str, int]] = []  # (end, call_id, choice index) of each trained output
    prev_end = 0
    for call_id, k in keys:
        found = choices.get((call_id, k))
        if found is None:
            raise InvariantError(f"sequence {si}: unknown call choice {call_id} #{k}")
        call, choice = found
        prompt, out, lp = call.prompt, choice.output, choice.logprobs
        if prompt is None or out is None:
            raise InvariantError(f"{_where(si, call_id, k)}: the call has no token ids to train")
        start = count(prompt)
        end = start + count(out)
        if start < prev_end:
            raise InvariantError(
                f"{_where(si, call_id, k)}: prompt ({start} ids) ends inside the previous output "
                f"(at {prev_end})"
            )
        if prompt[0] not in packed:
            packed[prompt[0]] = _ids_bytes(ids, prompt[0])
        if out[0] not in packed:
            packed[out[0]] = _ids_bytes(ids, out[0])
        if not packed[prompt[0]].startswith(payload(prompt)):
            raise InvariantError(f"{_where(si, call_id, k)}: the sequence does not start with the call's "
                                 f"{start} prompt ids")
        if not packed[out[0]].startswith(payload(out), start * ITEMSIZE[out[0]]):
            raise InvariantError(f"{_where(si, call_id, k)}: output ids not found at positions "
                                 f"[{start}, {end})")
        if lp is not None and count(lp) != end - start:
            raise InvariantError(f"{_where(si, call_id, k)}: logprobs differ from the engine's on the "
                                 f"sampled tokens ({count(lp)} engine logprobs for {end - start} output ids)")
        if lp is None and not seq.retokenized:
            raise InvariantError(f"{_where(si, call_id, k)}: logprobs differ from the engine's on the "
                                 "sampled tokens (the engine returned none; the sequence is not retokenized)")
        sampled[start:end] = b"\x01" * (end - start)
        if lp is not None:
            engine.append(lp)
            if covered is not sampled:
                covered[start:end] = b"\x01" * (end - start)
        spans.append((end, call_id, k))
        prev_end = end
    if prev_end != n:
        raise InvariantError(f"sequence {si}: {n - prev_end} trailing tokens after the last sampled output")
    _check_mask(si, ids, mask, sampled)
    expected = np.full(n, np.nan, LOGPROB_DTYPE)
    if engine:
        expected[np.frombuffer(covered, dtype=np.bool_)] = np.concatenate([values(b) for b in engine])
    _check_logprobs(si, seq, lps, expected, sampled, spans)
    return keys


def check_invariants(calls: list[CallRecord] | list[TokenCall], trajectory: Trajectory) -> None:
    """Raise ``InvariantError`` with a precise message if ``trajectory`` breaks a promise about ``calls``
    (``CallRecord``s or ``TokenCall``s)."""
    choices = _choices(token_calls(calls))
    trained: dict[tuple[str, int], int] = {}
    for si, seq in enumerate(trajectory.sequences):
        for key in _check_sequence(si, seq, choices):
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
