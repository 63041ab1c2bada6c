"""What the gateway reads of stored spans, built from the rows the store hands out (``Store.span_rows``,
``Store.call_rows``): span dicts (``list_spans``), ``CallRecord``s (``list_call_records[_many]``) and the
assembly's ``TokenCall``s (``iter_token_calls``), which keep the token columns as stored blobs and read
only the attributes the assembly needs.

``with_request=False`` skips the request body (``tracegym.request``, the messages: most of a call's
attributes); such records have ``request == {}``. Since migration 0003 the body has the ``request``
column, which that read does not select. Rows written before it keep the body inside ``attributes``; for
those the gateway wrote (``source = 'gateway'``) the body is cut out of the text unparsed: their
attributes were written in a fixed key order in which the request object is immediately followed by
``tracegym.choices`` and every other top-level value is a scalar or a list of scalars. Two facts make
cutting the text safe: inside a JSON string every ``"`` is escaped, so ``,"tracegym.request":{`` and
``,"tracegym.choices":[`` can only be object keys, never string content; and the first request key and
the last choices key of such a row are the top-level ones (the request, the only object before them, may
hold keys of those names, but it lies between them). The cut text must still parse and carry the call's
keys; anything else (another writer's key order) falls back to the full parse.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import orjson

from tracegym.gateway.traces.call_spans import (
    CALL_ID,
    CHOICES,
    REQUEST,
    ROLLOUT_ID,
    call_record_from_values,
    choice_blobs,
    is_call_attributes,
)
from tracegym.gateway.traces.codec import FLOAT_TAGS, ID_TAGS, blob_count, blob_length, decode, split_blob
from tracegym.gateway.traces.store.span_rows import COLUMNS
from tracegym.gateway.traces.token_calls import TokenCall, TokenChoice, one_id_type
from tracegym.types import CallRecord

if TYPE_CHECKING:
    from tracegym.gateway.traces.store import Store

CALL_COLUMNS = ("rollout_id", "source", "start_time_ns", "end_time_ns", "status", "status_message",
                "attributes", "prompt_ids", "output_ids", "output_logprobs", "request")
"""The columns of a ``CallRecord`` read."""
TOKEN_COLUMNS = ("rollout_id", "source", "start_time_ns", "status", "attributes", "prompt_ids", "output_ids",
                 "output_logprobs", "request")
"""The columns of a ``TokenCall`` read (``iter_token_calls``: always without the request)."""
_REQ = (b',"' + REQUEST.encode() + b'":{', ',"' + REQUEST + '":{')
_CHO = (b',"' + CHOICES.encode() + b'":[', ',"' + CHOICES + '":[')
_NOT_IN_SPAN_DICT = frozenset({"prompt_ids", "output_ids", "output_logprobs", "request"})
_Q = ord("q")


# -- span dicts --------------------------------------------------------------------------------------------
def decoded_choices(row: Mapping[str, Any]) -> list[dict] | None:
    """Per-choice dicts with decoded output ids and logprobs, or None for a non-LLM span."""
    meta = row["attributes"].get(CHOICES)
    if not isinstance(meta, list):
        return None
    ids, lps = choice_blobs(meta, row["output_ids"], row["output_logprobs"])
    return [
        {
            "index": c["index"],
            "output_ids": decode(ids[i]),
            "output_logprobs": decode(lps[i]),
            "finish_reason": c.get("finish_reason"),
            "message": c.get("message"),
            "weight_versions": c.get("weight_versions") or [],
        }
        for i, c in enumerate(meta)
    ]


def span_dict(row: Mapping[str, Any]) -> dict[str, Any]:
    """A ``Store.span_rows`` row as ``list_spans`` shows it."""
    d = {c: row[c] for c in COLUMNS if c not in _NOT_IN_SPAN_DICT}
    if row["request"] is not None:  # a call's request body has a column (in attributes in older rows)
        d["attributes"][REQUEST] = orjson.loads(row["request"])
    d["prompt_ids"] = decode(row["prompt_ids"])
    d["choices"] = decoded_choices(row)
    return d


def list_spans(store: Store, rollout_id: str) -> list[dict]:
    """All spans of a rollout (gateway and OTLP-ingested), ordered by start time, token arrays decoded:
    ``{"trace_id", "span_id", "parent_span_id", "rollout_id", "call_id", "source", "name", "kind",
    "start_time_ns", "end_time_ns", "status", "status_message", "attributes", "resource", "events",
    "prompt_ids", "choices"}``; for LLM spans ``choices`` is ``[{"index", "output_ids",
    "output_logprobs", "finish_reason", "message", "weight_versions"}]``, else None."""
    return [span_dict(r) for r in store.span_rows(rollout_id)]


# -- CallRecords -------------------------------------------------------------------------------------------
def attributes_without_request(text: bytes | str) -> dict[str, Any] | None:
    """A gateway span's attributes parsed without its request body (``REQUEST`` set to ``{}``), or None
    when the text is not laid out as the gateway writes it (see the module docstring)."""
    k = 0 if isinstance(text, bytes) else 1
    i = text.find(_REQ[k])  # type: ignore[arg-type]
    j = text.rfind(_CHO[k])  # type: ignore[arg-type]
    if i < 0 or j < i:
        return None
    try:
        attrs = orjson.loads(text[:i] + text[j:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(attrs, dict) or REQUEST in attrs or CALL_ID not in attrs:
        return None
    if not isinstance(attrs.get(CHOICES), list):
        return None
    attrs[REQUEST] = {}
    return attrs


def _call_attributes(source: str, text: bytes | str, request: Any,
                     with_request: bool) -> dict[str, Any] | None:
    """The attributes of an LLM call span, ``REQUEST`` included (``{}`` without ``with_request``), or None
    for an agent's own (OTLP) span. ``request``: the ``request`` column (its JSON text, or with
    ``with_request=False`` whether it is set); falsy for rows that keep the body in their attributes
    (written before migration 0003) and for spans that are not calls."""
    if request:
        attrs = orjson.loads(text)
        attrs[REQUEST] = orjson.loads(request) if with_request else {}
        return attrs if is_call_attributes(attrs) else None
    if not with_request and source == "gateway":
        attrs = attributes_without_request(text)
        if attrs is not None:  # checked to be a call's
            return attrs
    attrs = orjson.loads(text)
    if not is_call_attributes(attrs):
        return None
    if not with_request:
        attrs[REQUEST] = {}
    return attrs


def call_records_of_rows(rows: list[tuple], *, with_request: bool) -> list[CallRecord]:
    """One rollout's ``CallRecord``s from its ``CALL_COLUMNS`` rows (read with the same ``with_request``;
    agents' own OTLP spans skipped)."""
    out: list[CallRecord] = []
    for rid, source, t0, t1, status, message, text, prompt, output, lps, request in rows:
        attrs = _call_attributes(source, text, request, with_request)
        if attrs is not None:
            out.append(call_record_from_values(attrs, rid, status, message, t0, t1, prompt, output, lps))
    return out


def list_call_records_many(store: Store, rollout_ids: list[str], *,
                           with_request: bool = True) -> dict[str, list[CallRecord]]:
    """The LLM calls of several rollouts as ``CallRecord``s (bit-exact ids and logprobs), in start order:
    ``{rollout_id: [CallRecord, ...]}`` (rollouts without calls are absent). ``with_request=False``
    leaves the request body unread (``request == {}``, see the module docstring)."""
    out = {}
    for rid, rows in store.call_rows(rollout_ids, CALL_COLUMNS, with_request=with_request).items():
        calls = call_records_of_rows(rows, with_request=with_request)
        if calls:
            out[rid] = calls
    return out


def call_record(store: Store, call_id: str) -> CallRecord | None:
    """The gateway call answered with ``call_id`` as a ``CallRecord`` (None: no such call)."""
    row = store.call_row(call_id, CALL_COLUMNS)
    calls = call_records_of_rows([row], with_request=True) if row is not None else []
    return calls[0] if calls else None


def list_call_records(store: Store, rollout_id: str) -> list[CallRecord]:
    """The rollout's LLM calls as ``CallRecord``s, in start order."""
    return list_call_records_many(store, [rollout_id]).get(rollout_id, [])


def recent_call_records(store: Store, rollout_id: str, limit: int) -> list[CallRecord]:
    """The rollout's latest ``limit`` LLM calls as ``CallRecord``s, in start order (one indexed query)."""
    return call_records_of_rows(store.recent_call_rows(rollout_id, CALL_COLUMNS, limit), with_request=True)


# -- TokenCalls --------------------------------------------------------------------------------------------
class _ChoiceSpanAttributes(msgspec.Struct, gc=False):
    """The decoding schema of the part of a ``tracegym.choices`` entry a ``TokenChoice`` needs (its message
    is skipped unparsed)."""

    index: int
    n_output_ids: int | None = None
    n_output_logprobs: int | None = None
    weight_versions: list[tuple[str, int, int]] | None = None


_CALL_KEYS = {"call_id": CALL_ID, "choices": CHOICES, "rollout_id": ROLLOUT_ID,
              "agent_name": "tracegym.agent_name", "weight_version": "tracegym.weight_version",
              "retokenized": "tracegym.retokenized"}


class _CallSpanAttributes(msgspec.Struct, gc=False, rename=_CALL_KEYS):
    """Not a call type: the decoding schema of a stored call span's attributes JSON, the keys a
    ``TokenCall`` takes from it (choices by their lengths, whose blobs come from the token columns); every
    other key is skipped unparsed (no Python object for the messages, usage or sampling settings). It lives
    only inside ``token_calls_of_rows``."""

    call_id: str
    choices: list[_ChoiceSpanAttributes]
    rollout_id: str | None = None
    agent_name: str | None = None
    weight_version: str | None = None
    retokenized: bool = False


_decode_call_attributes = msgspec.json.Decoder(_CallSpanAttributes, strict=False).decode


def _older_call_attributes(rid: str, source: str, text: bytes | str) -> _CallSpanAttributes | None:
    """The call attributes of a row without a request column: an agent's own span (None), or a call
    written before migration 0003, whose request body is inside its attributes."""
    attrs = _call_attributes(source, text, None, False)
    try:
        return None if attrs is None else msgspec.convert(attrs, _CallSpanAttributes, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad LLM call span in rollout {rid!r}: {e}") from None


def _token_choices(meta: list[_ChoiceSpanAttributes], output: bytes | None, lps: bytes | None) -> list[TokenChoice]:
    """A call's ``TokenChoice``s cut from its token columns by the lengths its ``tracegym.choices`` entries
    record (``split_blob``, which raises ValueError for what does not match)."""
    outputs = split_blob(output, [c.n_output_ids for c in meta])
    logprobs = split_blob(lps, [c.n_output_logprobs for c in meta], FLOAT_TAGS)
    return [TokenChoice(c.index, outputs[i], logprobs[i], [w[0] for w in c.weight_versions or ()])
            for i, c in enumerate(meta)]


def token_calls_of_rows(rows: list[tuple]) -> list[TokenCall]:
    """One rollout's ``TokenCall``s from its ``TOKEN_COLUMNS`` rows; agents' own OTLP spans skipped.
    ValueError for malformed call attributes, a malformed token blob or one that does not match its
    choices' lengths. The id blobs take one type (``one_id_type``).

    Runs once per span of every trajectory read: the common call (written since migration 0003, n=1,
    blobs holding exactly the recorded lengths) takes one typed decode of its attributes and keeps its
    blobs as they are, in the loop itself."""
    out: list[TokenCall] = []
    wide = False
    for rid, source, t0, status, text, prompt, output, lps, request in rows:
        if request:  # only call spans have the request column (since migration 0003)
            try:
                m = _decode_call_attributes(text)
            except msgspec.DecodeError as e:
                raise ValueError(f"bad LLM call span in rollout {rid!r}: {e}") from None
        else:
            m = _older_call_attributes(rid, source, text)
            if m is None:
                continue
        if prompt is not None and blob_count(prompt, ID_TAGS) < 0:
            blob_length(prompt)  # raises with the reason
        meta = m.choices
        c = meta[0] if len(meta) == 1 else None
        if (c is not None and output is not None and lps is not None
                and blob_count(output, ID_TAGS) == c.n_output_ids
                and blob_count(lps, FLOAT_TAGS) == c.n_output_logprobs):
            wv = c.weight_versions
            choices = [TokenChoice(c.index, output, lps, [w[0] for w in wv] if wv else [])]
        else:
            choices = _token_choices(meta, output, lps)
        out.append(TokenCall(m.call_id, m.rollout_id or rid, m.agent_name, m.weight_version,
                             "error" if status == "error" else "ok", m.retokenized, t0, prompt, choices))
        if (prompt is not None and prompt[0] == _Q) or (output is not None and output[0] == _Q):
            wide = True
    return one_id_type(out) if wide else out


def iter_token_calls(store: Store, rollout_ids: list[str]) -> Iterator[tuple[str, list[TokenCall]]]:
    """``(rollout_id, calls)`` for each of ``rollout_ids`` in that order (``[]`` for a rollout without
    calls): the rollout's LLM calls as the assembly reads them (``TokenCall``: token columns as stored, no
    request body, no ``CallRecord``). The rows are read at once, in one transaction, and each rollout's
    calls are built only when it is reached, so a consumer that assembles one rollout at a time keeps one
    rollout's calls alive, not the page's (less for the garbage collector to scan, and the blobs are still
    in cache when they are compared)."""
    ids = list(rollout_ids)
    rows = store.call_rows(ids, TOKEN_COLUMNS, with_request=False)
    empty: list[tuple] = []
    return ((rid, token_calls_of_rows(rows.get(rid, empty))) for rid in ids)
