"""The read path of the assembly: CallRecords of many rollouts from one raw DBAPI query per page.

Why not SQLAlchemy Core here: per-row ``Row``/mapping work and parsing every JSON column (resource,
events) cost more than the query itself. This selects only the columns a CallRecord needs, reads the
attributes as raw JSON text and parses it once with orjson, and can hand the token arrays out as
``array.array`` (``arrays=True``: no Python int per prompt token).

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

from array import array
from typing import Any

import orjson

from tracegym.gateway.spans import CALL_ID, CHOICES, REQUEST, call_record_from_values, is_call_attributes
from tracegym.types import CallRecord

PAGE_IDS = 500
"""Rollout ids per query (well under SQLite's bound-parameter limit)."""
_COLUMNS = ("rollout_id", "source", "start_time_ns", "end_time_ns", "status", "status_message",
            "attributes", "prompt_ids", "output_ids", "output_logprobs", "request")
_REQ = (b',"' + REQUEST.encode() + b'":{', ',"' + REQUEST + '":{')
_CHO = (b',"' + CHOICES.encode() + b'":[', ',"' + CHOICES + '":[')


def select_sql(dialect: str, n_ids: int, with_request: bool = True) -> str:
    """The page query: the columns of ``_COLUMNS`` (attributes as raw JSON text) of the spans of ``n_ids``
    rollouts, ordered by rollout, start time, insertion. Without ``with_request`` the ``request`` column
    is only tested for NULL: its bytes are not read."""
    attributes = "attributes::text" if dialect == "postgresql" else "CAST(attributes AS BLOB)"
    request = "request" if with_request else "request IS NOT NULL"
    cols = ", ".join(attributes if c == "attributes" else request if c == "request" else c for c in _COLUMNS)
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


_INT64_TAG = ord("q")


def _widen(calls: list[CallRecord]) -> None:
    """Make every id array of a rollout ``q`` when one of them is (arrays of one type concatenate)."""
    def q(a: Any) -> Any:
        return array("q", a) if a is not None and a.typecode == "i" else a

    for c in calls:
        c.prompt_ids = q(c.prompt_ids)
        for ch in c.choices:
            ch.output_ids = q(ch.output_ids)


def read_call_rows(raw: Any, dialect: str, rollout_ids: list[str], *, with_request: bool) -> dict[str, list[tuple]]:
    """The raw column tuples (``_COLUMNS``) of the spans of ``rollout_ids``, grouped by rollout in start
    order (rollouts without spans are absent), read on the raw DBAPI connection ``raw`` inside the caller's
    transaction, ``PAGE_IDS`` rollouts per query. ``call_records`` turns one rollout's rows into records."""
    out: dict[str, list[tuple]] = {}
    cur = raw.cursor()
    try:
        for start in range(0, len(rollout_ids), PAGE_IDS):
            page = rollout_ids[start : start + PAGE_IDS]
            cur.execute(select_sql(dialect, len(page), with_request), (page,) if dialect == "postgresql" else page)
            for row in cur.fetchall():
                rows = out.get(row[0])
                if rows is None:
                    out[row[0]] = [row]
                else:
                    rows.append(row)
    finally:
        cur.close()
    return out


def call_records(rows: list[tuple], *, arrays: bool, with_request: bool) -> list[CallRecord]:
    """One rollout's ``CallRecord``s from its ``read_call_rows`` rows (read with the same ``with_request``;
    agents' own OTLP spans skipped). With ``arrays``, the id arrays all take the widest type present (arrays
    of one type concatenate)."""
    out: list[CallRecord] = []
    wide = False
    for rid, source, t0, t1, status, message, text, prompt, output, lps, request in rows:
        attrs = _call_attributes(source, text, request, with_request)
        if attrs is None:
            continue
        out.append(call_record_from_values(attrs, rid, status, message, t0, t1, prompt, output, lps,
                                           arrays=arrays))
        if (prompt and prompt[0] == _INT64_TAG) or (output and output[0] == _INT64_TAG):
            wide = True
    if wide and arrays:
        _widen(out)
    return out


def read_call_records(raw: Any, dialect: str, rollout_ids: list[str], *, arrays: bool,
                      with_request: bool) -> dict[str, list[CallRecord]]:
    """``{rollout_id: [CallRecord, ...]}`` in start order (rollouts without calls are absent); see
    ``read_call_rows``."""
    out = {}
    for rid, rows in read_call_rows(raw, dialect, rollout_ids, with_request=with_request).items():
        calls = call_records(rows, arrays=arrays, with_request=with_request)
        if calls:
            out[rid] = calls
    return out
