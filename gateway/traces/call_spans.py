"""CallRecord <-> span attributes <-> store row.

A call is one span ``{operation} {model}`` with the OpenTelemetry GenAI attributes plus tracegym's own
(``tracegym.api``: the public API the call came in through; Responses and Messages calls are ``chat``).
Token arrays are compact bytes attributes (``codec``; OTLP may bring plain int/float arrays), stored in
binary columns; ``tracegym.request`` and ``tracegym.choices`` are JSON strings on the span, structured JSON
in the store. A record becomes a row in one place, ``call_record_store_row``; attributes from elsewhere
(OTLP, SDK spans) through ``attributes_to_row_fields``; ``call_record_from_values`` rebuilds a record.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterable
from typing import Any

import orjson

from tracegym.gateway.traces.codec import (
    FLOAT_TAGS,
    decode,
    decode_array,
    encode_floats,
    encode_ints,
    split_blob,
)
from tracegym.gateway.traces.store.span_rows import JSON_NULL, SpanBatch, json_text, text_checks
from tracegym.types import CallRecord, ChoiceRecord, WeightVersionSpan

PROMPT_IDS = "tracegym.prompt_token_ids"
OUTPUT_IDS = "tracegym.output_token_ids"
OUTPUT_LOGPROBS = "tracegym.output_logprobs"
REQUEST = "tracegym.request"
CHOICES = "tracegym.choices"
ROLLOUT_ID = "tracegym.rollout_id"
CALL_ID = "tracegym.call_id"
_JSON_ATTRS = (REQUEST, CHOICES)
_ID_TYPES, _FLOAT_TYPES = frozenset("iq"), frozenset("fd")
_SAMPLING = (
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("seed", "gen_ai.request.seed"),
)
_NUMBER = (int, float)


def span_name(rec: CallRecord) -> str:
    return f"{rec.operation} {rec.model}"


def _concat(parts: list[list | None]) -> tuple[list, list[int | None]]:
    flat: list = []
    lens: list[int | None] = []
    for p in parts:
        lens.append(None if p is None else len(p))
        if p is not None:
            flat.extend(p)
    return flat, lens


def _outputs(choices: list[ChoiceRecord]) -> tuple[list, list, list, list, tuple[str, ...]]:
    """Concatenated output ids and logprobs of the choices, their per-choice lengths, finish reasons (for
    n != 1: ``_outputs_and_meta`` has the n=1 case)."""
    ids, id_lens = _concat([c.output_ids for c in choices])
    lps, lp_lens = _concat([c.output_logprobs for c in choices])
    return ids, lps, id_lens, lp_lens, tuple([c.finish_reason or "" for c in choices])


def _choice_meta(c: ChoiceRecord, n_ids: int | None, n_lps: int | None) -> dict[str, Any]:
    """One choice's entry of ``tracegym.choices`` (its ids and logprobs go to the token blobs)."""
    return {
        "index": c.index,
        "finish_reason": c.finish_reason,
        "message": c.message,
        "weight_versions": [[w.version, w.start, w.end] for w in c.weight_versions],
        "n_output_ids": n_ids,
        "n_output_logprobs": n_lps,
    }


def _outputs_and_meta(choices: list[ChoiceRecord]
                      ) -> tuple[list, list, tuple[str, ...], list[dict[str, Any]]]:
    """``_outputs`` (ids, logprobs, finish reasons) and the ``tracegym.choices`` metadata; the common n=1
    call without the concatenation and length lists."""
    if len(choices) != 1:
        ids, lps, id_lens, lp_lens, finish = _outputs(choices)
        return ids, lps, finish, [_choice_meta(c, id_lens[i], lp_lens[i]) for i, c in enumerate(choices)]
    c = choices[0]
    ids, lps = c.output_ids, c.output_logprobs
    meta = _choice_meta(c, None if ids is None else len(ids), None if lps is None else len(lps))
    return ids or [], lps or [], (c.finish_reason or "",), [meta]


def stored_attributes(rec: CallRecord) -> tuple[dict[str, Any], list, list]:
    """The call's attributes as the store keeps them in ``attributes`` (``tracegym.choices`` as structured
    JSON; no token arrays, and no ``tracegym.request``: the request body, most of a call's attributes, has
    the ``request`` column, which the assembly read skips), and the concatenated output ids and logprobs
    of its choices.
    On the span export hot path: plain statements, no per-key loops (the key order is the stored JSON's)."""
    ids, lps, finish, meta = _outputs_and_meta(rec.choices)
    req = rec.request
    call_id, upstream = rec.call_id, rec.upstream_kind
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": rec.operation,
        "gen_ai.system": upstream,
        "gen_ai.request.model": rec.model,
        "gen_ai.response.model": rec.model,
        "gen_ai.response.id": call_id,
        "gen_ai.response.finish_reasons": finish,
        "gen_ai.usage.input_tokens": rec.input_tokens,
        "gen_ai.usage.output_tokens": rec.output_tokens,
        CALL_ID: call_id,
        ROLLOUT_ID: rec.rollout_id,
        "tracegym.upstream_kind": upstream,
        "tracegym.drift": rec.drift,
        "tracegym.prefix_len": rec.prefix_len,
        "tracegym.retokenized": rec.retokenized,
        CHOICES: meta,
    }
    get = req.get
    for key, attr in _SAMPLING:
        value = get(key)
        if value is not None and isinstance(value, _NUMBER):
            attrs[attr] = value
    max_tokens = get("max_tokens")
    if max_tokens is None:
        max_tokens = get("max_completion_tokens")
    if isinstance(max_tokens, int):
        attrs["gen_ai.request.max_tokens"] = max_tokens
    if rec.task_id is not None:
        attrs["tracegym.task_id"] = rec.task_id
    if rec.agent_name is not None:
        attrs["tracegym.agent_name"] = rec.agent_name
    if rec.api is not None:
        attrs["tracegym.api"] = rec.api
    if rec.tool_parse is not None:
        attrs["tracegym.tool_parse"] = rec.tool_parse
    if rec.lora_adapter is not None:
        attrs["tracegym.lora_adapter"] = rec.lora_adapter
    if rec.weight_version is not None:
        attrs["tracegym.weight_version"] = rec.weight_version
    if rec.upstream is not None:
        attrs["tracegym.upstream"] = rec.upstream
    first_token = rec.first_token_time_ns
    if first_token is not None:
        attrs["tracegym.first_token_time_ns"] = first_token
    if rec.error is not None:
        attrs["tracegym.error"] = rec.error
    if first_token is not None and rec.start_time_ns:
        attrs["tracegym.time_to_first_token_s"] = (first_token - rec.start_time_ns) / 1e9
    return attrs, ids, lps


def call_record_attributes(rec: CallRecord) -> dict[str, Any]:
    """The span attributes of a call (all values valid OpenTelemetry attribute types): the stored
    attributes with the request/choices JSON as strings and the token arrays as compact bytes."""
    attrs, ids, lps = stored_attributes(rec)
    attrs[REQUEST] = orjson.dumps(rec.request, option=orjson.OPT_NON_STR_KEYS).decode()
    attrs[CHOICES] = orjson.dumps(attrs[CHOICES]).decode()
    attrs[OUTPUT_IDS] = encode_ints(ids)
    attrs[OUTPUT_LOGPROBS] = encode_floats(lps)
    if rec.prompt_ids is not None:
        attrs[PROMPT_IDS] = encode_ints(rec.prompt_ids)
    return attrs


CALL_ROW_TEXT = text_checks(("rollout_id", "call_id", "name", "status_message"))
"""The string columns of a ``call_record_store_row`` tuple that ``SpanBatch.add`` must check: those taken
from the record. The others are constants that fit, or the trace and span ids, which the caller generates
(32 and 16 hex digits)."""


def call_record_store_row(rec: CallRecord, *, trace_id: str, span_id: str, resource_json: str,
                          start_time_ns: int, end_time_ns: int) -> tuple:
    """The ``spans`` value tuple (``store.span_rows.COLUMNS`` order) of a call, straight from the record;
    what the span's attributes (``call_record_attributes``) give through ``attributes_to_row_fields``."""
    attrs, ids, lps = stored_attributes(rec)
    prompt = rec.prompt_ids
    if rec.status == "error":
        status, message = "error", rec.error
    else:
        status, message = "ok", None
    return (
        trace_id, span_id, None, rec.rollout_id, rec.call_id, "gateway", span_name(rec),
        "client", start_time_ns, end_time_ns, status, message, json_text(attrs), resource_json, JSON_NULL,
        None if prompt is None else encode_ints(prompt), encode_ints(ids), encode_floats(lps),
        json_text(rec.request),
    )


def call_batch(recs: Iterable[CallRecord]) -> SpanBatch:
    """The records' rows (``call_record_store_row``: new random trace and span ids, no resource, the
    records' own times) as one ``SpanBatch``; ValueError when a value does not fit its column."""
    batch = SpanBatch()
    for rec in recs:
        row = call_record_store_row(rec, trace_id=secrets.token_hex(16), span_id=secrets.token_hex(8),
                                    resource_json=JSON_NULL, start_time_ns=rec.start_time_ns,
                                    end_time_ns=rec.end_time_ns)
        batch.add(row, rec.task_id, rec.weight_version, CALL_ROW_TEXT)
    return batch


def insert_call_records(store: Any, recs: Iterable[CallRecord]) -> int:
    """Store the records as call spans (``call_batch``) in one ``store.insert_spans``; the number
    inserted. For tests, imports and tools: the gateway records its calls through
    ``recorder.TraceRecorder``."""
    return store.insert_spans(call_batch(recs))


def _blob(value: Any, floats: bool) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray | memoryview):
        value = bytes(value)
        arr = decode_array(value)  # ValueError: a missing/unknown tag byte, a misaligned length
        if arr.typecode not in (_FLOAT_TYPES if floats else _ID_TYPES):
            kind, tags = ("logprobs", "f or d") if floats else ("token ids", "i or q")
            raise ValueError(f"{kind} bytes must be tagged {tags}, got {arr.typecode!r}")
        return value
    if isinstance(value, list | tuple):
        return encode_floats(value) if floats else encode_ints(value)
    raise ValueError(f"token array attribute must be bytes or a list, got {type(value).__name__}")


def json_safe(value: Any) -> Any:
    """``value`` with bytes turned into base64 text and tuples into lists (storable as JSON)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value


def attributes_to_row_fields(attrs: dict[str, Any]) -> dict[str, Any]:
    """Split span attributes into the store's columns: token arrays -> blobs, JSON strings -> structured
    JSON, any other bytes -> base64 text. Returns ``attributes``, ``prompt_ids``, ``output_ids``,
    ``output_logprobs``, ``rollout_id`` and ``call_id``, and for an LLM call span ``request`` (the JSON text
    of ``tracegym.request``, which then leaves ``attributes``)."""
    rest = dict(attrs)
    fields = {
        "prompt_ids": _blob(rest.pop(PROMPT_IDS, None), floats=False),
        "output_ids": _blob(rest.pop(OUTPUT_IDS, None), floats=False),
        "output_logprobs": _blob(rest.pop(OUTPUT_LOGPROBS, None), floats=True),
    }
    for key in _JSON_ATTRS:
        if isinstance(rest.get(key), str):
            rest[key] = orjson.loads(rest[key])
    for key, value in rest.items():
        if isinstance(value, bytes | bytearray | memoryview | list | tuple | dict):
            rest[key] = json_safe(value)
    fields["attributes"] = rest
    fields["rollout_id"] = rest.get(ROLLOUT_ID)
    fields["call_id"] = rest.get(CALL_ID)
    if is_call_attributes(rest):
        check_call_attributes(rest, fields)
        fields["request"] = json_text(rest.pop(REQUEST))  # a column of its own (see ``stored_attributes``)
    return fields


def check_call_attributes(attrs: dict[str, Any], fields: dict[str, Any]) -> None:
    """ValueError unless the CallRecord of an LLM call span (``is_call_attributes``) can be rebuilt from
    ``attrs`` and the token array blobs of ``fields``: what every later read of its rollout does (a span
    stored with a missing key or arrays that do not match the choices would break them all)."""
    try:
        rec = call_record_from_values(attrs, fields.get("rollout_id"), "ok", None, 0, 0, fields["prompt_ids"],
                                      fields["output_ids"], fields["output_logprobs"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        detail = f"lacks {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"bad LLM call span ({CALL_ID} {attrs.get(CALL_ID)!r}): {detail}") from None
    for name in ("call_id", "operation", "model"):
        if not isinstance(getattr(rec, name), str):
            raise ValueError(f"bad LLM call span: its {name} must be a string, got {getattr(rec, name)!r}")
    for name in ("task_id", "agent_name", "weight_version", "error"):
        if not isinstance(getattr(rec, name), str | None):
            raise ValueError(f"bad LLM call span: its {name} must be a string, got {getattr(rec, name)!r}")
    for c in rec.choices:
        if type(c.index) is not int or not all(
                isinstance(w.version, str) and type(w.start) is int and type(w.end) is int
                for w in c.weight_versions):
            raise ValueError(f"bad LLM call span: choice {c.index!r} needs an integer index and "
                             "[version, start, end] weight versions")


def is_call_attributes(a: dict) -> bool:
    """True for the attributes of an LLM call span (gateway-written or OTLP-ingested with the call keys);
    an agent's own spans lack them."""
    return isinstance(a.get(CHOICES), list) and isinstance(a.get(REQUEST), dict) and CALL_ID in a


def choice_blobs(meta: list, output_blob: bytes | None, logprob_blob: bytes | None
                 ) -> tuple[list[bytes | None], list[bytes | None]]:
    """Each choice's output id blob and logprob blob, cut from a call's two columns by the lengths its
    ``tracegym.choices`` entries record (ValueError for a malformed or too short blob)."""
    return (split_blob(output_blob, [c.get("n_output_ids") for c in meta]),
            split_blob(logprob_blob, [c.get("n_output_logprobs") for c in meta], FLOAT_TAGS))


def _choice_records(meta: list, output_blob: Any, logprob_blob: Any) -> list[ChoiceRecord]:
    ids, lps = choice_blobs(meta, output_blob, logprob_blob)
    return [
        ChoiceRecord(c["index"], decode(ids[i]), decode(lps[i]), c.get("finish_reason"), c.get("message"),
                     [WeightVersionSpan(v, s, e) for v, s, e in c.get("weight_versions") or ()])
        for i, c in enumerate(meta)
    ]


def call_record_from_values(a: dict, rollout_id: str | None, status: str, status_message: str | None,
                            start_time_ns: int, end_time_ns: int, prompt_blob: Any, output_blob: Any,
                            logprob_blob: Any) -> CallRecord:
    """Rebuild the CallRecord of an LLM call span (``is_call_attributes``) from its column values (the
    record read calls it once per span straight from the DBAPI tuple: no row dict, one lookup per
    attribute). ``CallRecord`` is built positionally, in its field order, which is cheaper than by keyword
    (the store round-trip tests compare every field)."""
    get = a.get
    meta = get(CHOICES)
    error = get("tracegym.error")
    if error is None and status == "error" and "tracegym.error" not in a:
        error = status_message
    upstream = get("tracegym.upstream_kind")
    if upstream is None and "tracegym.upstream_kind" not in a:
        upstream = get("gen_ai.system", "")
    return CallRecord(
        a[CALL_ID], get(ROLLOUT_ID) or rollout_id, a["gen_ai.operation.name"], a["gen_ai.request.model"],
        upstream, a[REQUEST],
        _choice_records(meta, output_blob, logprob_blob) if isinstance(meta, list) else [],
        decode(prompt_blob),
        get("tracegym.task_id"), get("tracegym.agent_name"), get("tracegym.weight_version"),
        get("tracegym.drift", "none"), get("tracegym.prefix_len", 0), get("tracegym.retokenized", False),
        get("gen_ai.usage.input_tokens", 0), get("gen_ai.usage.output_tokens", 0), start_time_ns, end_time_ns,
        get("tracegym.first_token_time_ns"), "error" if status == "error" else "ok", error,
        get("tracegym.api"), get("tracegym.tool_parse"), get("tracegym.upstream"), get("tracegym.lora_adapter"),
    )
