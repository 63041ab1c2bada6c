"""The read path of the assembly: the calls of many rollouts from one raw DBAPI query per page, as
``CallRecord``s or as the assembly's ``TokenCall``s.

Why not SQLAlchemy Core here: per-row ``Row``/mapping work and parsing every JSON column (resource,
events) cost more than the query itself. This selects only the columns a CallRecord needs and reads the
attributes as raw JSON text, parsed once with orjson. ``token_calls`` builds no ``CallRecord``: it keeps
the token columns as they are stored (blobs, see ``assembly_calls``) and reads only the attributes the
assembly needs.

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

from itertools import groupby
from operator import itemgetter
from typing import Any

import msgspec
import orjson

from tracegym.gateway.assembly_calls import TokenCall, TokenChoice, one_id_type
from tracegym.gateway.spans import (
    CALL_ID,
    CHOICES,
    REQUEST,
    ROLLOUT_ID,
    call_record_from_values,
    is_call_attributes,
)
from tracegym.gateway.store.codec import FLOAT_TAGS, ID_TAGS, blob_count, blob_length, split_blob
from tracegym.types import CallRecord

PAGE_IDS = 500
"""Rollout ids per query (well under SQLite's bound-parameter limit)."""
_COLUMNS = ("rollout_id", "source", "start_time_ns", "end_time_ns", "status", "status_message",
            "attributes", "prompt_ids", "output_ids", "output_logprobs", "request")
"""The columns of a ``CallRecord`` read."""
TOKEN_COLUMNS = ("rollout_id", "source", "start_time_ns", "status", "attributes", "prompt_ids", "output_ids",
                 "output_logprobs", "request")
"""The columns of a ``TokenCall`` read (always without the request: ``token_calls``)."""
_REQ = (b',"' + REQUEST.encode() + b'":{', ',"' + REQUEST + '":{')
_CHO = (b',"' + CHOICES.encode() + b'":[', ',"' + CHOICES + '":[')


def select_sql(dialect: str, n_ids: int, with_request: bool = True,
               columns: tuple[str, ...] = _COLUMNS) -> str:
    """The page query: ``columns`` (attributes as raw JSON text) of the spans of ``n_ids`` rollouts, ordered
    by rollout, start time, insertion. Without ``with_request`` the ``request`` column is only tested for
    NULL: its bytes are not read."""
    attributes = "attributes::text" if dialect == "postgresql" else "CAST(attributes AS BLOB)"
    request = "request" if with_request else "request IS NOT NULL"
    cols = ", ".join(attributes if c == "attributes" else request if c == "request" else c for c in columns)
    where = "rollout_id = ANY(%s)" if dialect == "postgresql" else f"rollout_id IN ({','.join('?' * n_ids)})"
    return f"SELECT {cols} FROM spans WHERE {where} ORDER BY rollout_id, start_time_ns, id"


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


def _call_attributes(source: str, text: bytes | str, request: Any, with_request: bool) -> dict[str, Any] | None:
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


def read_call_rows(raw: Any, dialect: str, rollout_ids: list[str], *, with_request: bool,
                   columns: tuple[str, ...] = _COLUMNS) -> dict[str, list[tuple]]:
    """The raw column tuples (``columns``, the rollout id first) of the spans of ``rollout_ids``, grouped by
    rollout in start order (rollouts without spans are absent), read on the raw DBAPI connection ``raw``
    inside the caller's transaction, ``PAGE_IDS`` rollouts per query. ``call_records`` (``_COLUMNS``) and
    ``token_calls`` (``TOKEN_COLUMNS``) turn one rollout's rows into calls."""
    out: dict[str, list[tuple]] = {}
    cur = raw.cursor()
    try:
        for start in range(0, len(rollout_ids), PAGE_IDS):
            page = rollout_ids[start : start + PAGE_IDS]
            cur.execute(select_sql(dialect, len(page), with_request, columns),
                        (page,) if dialect == "postgresql" else page)
            # The rows come ordered by rollout: group them in C.
            out.update((rid, list(rows)) for rid, rows in groupby(cur.fetchall(), itemgetter(0)))
    finally:
        cur.close()
    return out


def call_records(rows: list[tuple], *, with_request: bool) -> list[CallRecord]:
    """One rollout's ``CallRecord``s from its ``read_call_rows`` rows (read with the same ``with_request``;
    agents' own OTLP spans skipped)."""
    out: list[CallRecord] = []
    for rid, source, t0, t1, status, message, text, prompt, output, lps, request in rows:
        attrs = _call_attributes(source, text, request, with_request)
        if attrs is not None:
            out.append(call_record_from_values(attrs, rid, status, message, t0, t1, prompt, output, lps))
    return out


class _ChoiceMeta(msgspec.Struct, gc=False):
    """The part of a ``tracegym.choices`` entry the assembly reads (its message is skipped unparsed)."""

    index: int
    n_output_ids: int | None = None
    n_output_logprobs: int | None = None
    weight_versions: list[tuple[str, int, int]] | None = None


_CALL_KEYS = {"call_id": CALL_ID, "choices": CHOICES, "rollout_id": ROLLOUT_ID,
              "agent_name": "tracegym.agent_name", "weight_version": "tracegym.weight_version",
              "retokenized": "tracegym.retokenized"}


class _CallMeta(msgspec.Struct, gc=False, rename=_CALL_KEYS):
    """The attributes of an LLM call span the assembly reads; every other key is skipped unparsed (no Python
    object for the messages, usage or sampling settings)."""

    call_id: str
    choices: list[_ChoiceMeta]
    rollout_id: str | None = None
    agent_name: str | None = None
    weight_version: str | None = None
    retokenized: bool = False


_decode_meta = msgspec.json.Decoder(_CallMeta, strict=False).decode


def _older_call_meta(rid: str, source: str, text: bytes | str) -> _CallMeta | None:
    """The call attributes of a row without a request column: an agent's own span (None), or a call
    written before migration 0003, whose request body is inside its attributes."""
    attrs = _call_attributes(source, text, None, False)
    try:
        return None if attrs is None else msgspec.convert(attrs, _CallMeta, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad LLM call span in rollout {rid!r}: {e}") from None


def _token_choices(meta: list[_ChoiceMeta], output: bytes | None, lps: bytes | None) -> list[TokenChoice]:
    """A call's ``TokenChoice``s cut from its token columns by the lengths its ``tracegym.choices`` entries
    record (``split_blob``, which raises ValueError for what does not match)."""
    outputs = split_blob(output, [c.n_output_ids for c in meta])
    logprobs = split_blob(lps, [c.n_output_logprobs for c in meta], FLOAT_TAGS)
    return [TokenChoice(c.index, outputs[i], logprobs[i], [w[0] for w in c.weight_versions or ()])
            for i, c in enumerate(meta)]


def token_calls(rows: list[tuple]) -> list[TokenCall]:
    """One rollout's ``TokenCall``s (what the assembly reads: the token columns as they are, no
    ``CallRecord``) from its ``read_call_rows`` rows (``TOKEN_COLUMNS``); agents' own OTLP spans skipped.
    ValueError for malformed call attributes, a malformed token blob or one that does not match its
    choices' lengths. The id blobs take one type (``one_id_type``).

    Once per span of every trajectory read: the common call (written since migration 0003, n=1, blobs
    holding exactly the recorded lengths) takes one typed decode of its attributes and keeps its blobs
    as they are, in the loop itself."""
    out: list[TokenCall] = []
    wide = False
    for rid, source, t0, status, text, prompt, output, lps, request in rows:
        if request:  # only call spans have the request column (since migration 0003)
            try:
                m = _decode_meta(text)
            except msgspec.DecodeError as e:
                raise ValueError(f"bad LLM call span in rollout {rid!r}: {e}") from None
        else:
            m = _older_call_meta(rid, source, text)
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


_Q = ord("q")


def read_call_records(raw: Any, dialect: str, rollout_ids: list[str], *, with_request: bool
                      ) -> dict[str, list[CallRecord]]:
    """``{rollout_id: [CallRecord, ...]}`` in start order (rollouts without calls are absent); see
    ``read_call_rows``."""
    out = {}
    for rid, rows in read_call_rows(raw, dialect, rollout_ids, with_request=with_request).items():
        calls = call_records(rows, with_request=with_request)
        if calls:
            out[rid] = calls
    return out
