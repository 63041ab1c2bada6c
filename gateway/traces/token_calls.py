"""What the assembly reads of a call: ``TokenCall``, its token arrays kept as the store's blobs.

A blob (``codec``) is one tag byte, then little-endian values; two id blobs of one tag hold equal ids
exactly when their bytes are equal, so the assembly compares prefixes and joins sequences as bytes (a
deliberate fast path over the storage encoding). ``values`` is the in-memory view of a blob: a numpy array
(``tracegym.arrays``). ``token_calls`` makes the ``TokenCall``s of ``CallRecord``s and gives a rollout's
id blobs one tag.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import numpy as np

from tracegym.gateway.traces.codec import DTYPES, ITEMSIZE, array_blob, widen_ids
from tracegym.types import CallRecord

_Q = ord("q")


class TokenChoice(msgspec.Struct, gc=False):
    """One choice of a call: ``output`` ids and the engine's ``logprobs`` as blobs (None when the upstream
    gave none), the weight ``versions`` that sampled it (names, in order; empty when not recorded)."""

    index: int
    output: bytes | None
    logprobs: bytes | None
    versions: list[str]


class TokenCall(msgspec.Struct, gc=False):
    """One LLM call as the assembly reads it, the stage after ``CallRecord``: a ``CallRecord`` is the whole
    call as recorded (request, messages, timings; the SDK's contract), a ``TokenCall`` only its token arrays
    as the store's blobs (``prompt`` ids, None when unknown, and its choices) and the fields the assembly
    needs, as in ``CallRecord`` (``status`` is ``ok`` or ``error``). The store's read makes them straight
    from the span rows (``reads.token_calls_of_rows``), without a ``CallRecord``; ``token_calls`` converts
    ``CallRecord``s.

    Both are msgspec structs without garbage-collector tracking (``gc=False``: they hold no reference
    that could close a cycle): a store read makes one per span, and a tracked object costs the collector
    a scan for as long as it lives."""

    call_id: str
    rollout_id: str | None
    agent_name: str | None
    weight_version: str | None
    status: str
    retokenized: bool
    start_time_ns: int
    prompt: bytes | None
    choices: list[TokenChoice]


def _record_call(rec: CallRecord) -> TokenCall:
    choices = [
        TokenChoice(
            ch.index,
            None if ch.output_ids is None else array_blob(ch.output_ids),
            None if ch.output_logprobs is None else array_blob(ch.output_logprobs, floats=True),
            [w.version for w in ch.weight_versions],
        )
        for ch in rec.choices
    ]
    prompt = None if rec.prompt_ids is None else array_blob(rec.prompt_ids)
    return TokenCall(rec.call_id, rec.rollout_id, rec.agent_name, rec.weight_version,
                     "error" if rec.status == "error" else "ok", bool(rec.retokenized), rec.start_time_ns,
                     prompt, choices)


def one_id_type(calls: list[TokenCall]) -> list[TokenCall]:
    """``calls`` with every id blob ``q`` if one of them is (in place; they are returned). The store's
    read and ``token_calls`` both end with it."""
    if not any((c.prompt is not None and c.prompt[0] == _Q)
               or any(ch.output is not None and ch.output[0] == _Q for ch in c.choices) for c in calls):
        return calls
    for c in calls:
        if c.prompt is not None:
            c.prompt = widen_ids(c.prompt)
        for ch in c.choices:
            if ch.output is not None:
                ch.output = widen_ids(ch.output)
    return calls


def token_calls(calls: Iterable[CallRecord | TokenCall]) -> list[TokenCall]:
    """The ``TokenCall``s of a rollout's calls. ``TokenCall``s alone are taken as they are (the store's
    read gives them one id type); otherwise ``CallRecord``s are converted and all get one id type
    (``one_id_type``). ValueError for ids that are not integers within int64 or logprobs that are not
    numbers. (Blobs of two id types never compare equal: calls left with both would still assemble
    exactly, only into more sequences than needed.)"""
    calls = list(calls)
    if all(type(c) is TokenCall for c in calls):
        return calls  # type: ignore[return-value]
    converted = [c if type(c) is TokenCall else _record_call(c) for c in calls]  # type: ignore[arg-type]
    return one_id_type(converted)


def count(blob: bytes | None) -> int:
    """Values in a well-formed blob (0 for None); the caller has checked it (``codec.blob_length``)."""
    return 0 if blob is None else (len(blob) - 1) // ITEMSIZE[blob[0]]


def values(blob: bytes) -> np.ndarray:
    """A read-only numpy view of a blob's values (its own type, little-endian)."""
    return np.frombuffer(blob, dtype=DTYPES[blob[0]], offset=1)


def payload(blob: bytes) -> bytes:
    """The value bytes of a blob (without its tag). A copy: for arrays of this size, cheaper to make than a
    memoryview slice, and bytes methods take it on their fast path."""
    return blob[1:]

