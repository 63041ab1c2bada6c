"""OTLP/HTTP trace ingest: ``POST /v1/traces`` with ``application/x-protobuf`` or ``application/json``
(optionally gzip/deflate ``Content-Encoding``), as sent by ``opentelemetry-exporter-otlp-proto-http``.

Spans land in the same store as the gateway's own, linked to a rollout by the ``tracegym.rollout_id``
attribute of the span, else of its resource, else the request's ``X-Rollout-Id`` header. Spans with none
are stored unlinked. Re-sent spans (same trace and span id) are stored once.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import orjson
from fastapi import APIRouter, Request
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sqlalchemy.exc import DataError
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from tracegym.gateway.deps import BodyLimitDep, StoreDep
from tracegym.gateway.openai_errors import OpenAIError, bad_request, error_response, error_responses
from tracegym.gateway.proxy.admission import ByteBudget
from tracegym.gateway.traces.call_spans import ROLLOUT_ID, attributes_to_row_fields, json_safe
from tracegym.gateway.traces.store.span_rows import SpanBatch

router = APIRouter(tags=["otlp"])

_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS = {0: "unset", 1: "ok", 2: "error"}
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def any_value(v: AnyValue) -> Any:
    """A Python value from an OTLP AnyValue (bytes stay bytes)."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return key_values(v.kvlist_value.values)
    return getattr(v, which)


def key_values(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def _hex_ids_to_base64(obj: Any) -> None:
    """OTLP/JSON encodes trace/span ids as hex, not base64 as proto3 JSON does: convert in place."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in _ID_FIELDS and isinstance(value, str):
                try:
                    obj[key] = base64.b64encode(bytes.fromhex(value)).decode()
                except ValueError:
                    raise ValueError(f"{key} must be hex, got {value!r}") from None
            else:
                _hex_ids_to_base64(value)
    elif isinstance(obj, list):
        for value in obj:
            _hex_ids_to_base64(value)


def _objects(value: Any, where: str) -> list[Any]:
    """``value``, a list of objects (null counts as empty, as in proto3's JSON mapping)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{where} must be a list of objects")
    return value


def _check_lists(data: Any) -> None:
    """The request's nesting, checked before protobuf's parser (which takes a string for a message in a
    list): an object whose resourceSpans, their scopeSpans, their spans and the spans' attributes and
    events are lists of objects."""
    if not isinstance(data, dict):
        raise ValueError(f"body must be a JSON object (an ExportTraceServiceRequest), not {type(data).__name__}")
    for i, rs in enumerate(_objects(data.get("resourceSpans"), "resourceSpans")):
        for j, ss in enumerate(_objects(rs.get("scopeSpans"), f"resourceSpans[{i}].scopeSpans")):
            for k, span in enumerate(_objects(ss.get("spans"), f"resourceSpans[{i}].scopeSpans[{j}].spans")):
                for key in ("attributes", "events"):
                    _objects(span.get(key), f"resourceSpans[{i}].scopeSpans[{j}].spans[{k}].{key}")


def parse_request(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    """Decode an export request; ValueError with a clear message on bad input."""
    req = ExportTraceServiceRequest()
    if content_type == "application/x-protobuf":
        try:
            req.ParseFromString(body)
        except DecodeError as e:
            raise ValueError(f"body is not a valid OTLP protobuf ExportTraceServiceRequest: {e}") from e
        return req
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"body is not valid JSON: {e}") from e
    _check_lists(data)
    _hex_ids_to_base64(data)
    try:
        json_format.ParseDict(data, req, ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise ValueError(f"body is not an OTLP/JSON ExportTraceServiceRequest: {e}") from e
    return req


def _span_row(span: Span, resource: dict[str, Any], scope: str | None, header_rollout: str | None) -> dict:
    attrs = key_values(span.attributes)
    rollout = attrs.get(ROLLOUT_ID) or resource.get(ROLLOUT_ID) or header_rollout
    if rollout is not None:
        attrs[ROLLOUT_ID] = str(rollout)
    if scope:
        attrs.setdefault("otel.scope.name", scope)
    events = [{"name": e.name, "time_ns": e.time_unix_nano, "attributes": key_values(e.attributes)}
              for e in span.events]
    fields = attributes_to_row_fields(attrs)
    if len(span.trace_id) != 16 or len(span.span_id) != 8:
        raise ValueError(f"span {span.name!r} has a bad trace_id/span_id length")
    return {
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "source": "otlp",
        "name": span.name,
        "kind": _KINDS.get(span.kind, "unspecified"),
        "start_time_ns": span.start_time_unix_nano,
        "end_time_ns": span.end_time_unix_nano,
        "status": _STATUS.get(span.status.code, "unset"),
        "status_message": span.status.message or None,
        "resource": json_safe(resource),
        "events": json_safe(events) or None,
        **fields,
    }


def request_rows(req: ExportTraceServiceRequest, header_rollout: str | None) -> list[dict]:
    rows = []
    for rs in req.resource_spans:
        resource = key_values(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                rows.append(_span_row(span, resource, ss.scope.name or None, header_rollout))
    return rows


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The body inflated, refusing (413) one that inflates past ``limit`` bytes without inflating more."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise OpenAIError(415, f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
        if len(out) > limit or inflater.unconsumed_tail:
            raise OpenAIError(413, f"request body inflates past the limit of {limit} bytes",
                              code="request_too_large")
        out += inflater.flush()
    except zlib.error as e:
        raise bad_request(f"body is not valid {encoding} data: {e}") from e
    if not inflater.eof:
        raise bad_request(f"body is not valid {encoding} data: truncated")
    return out
    raise OpenAIError(415, f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")


def _ingest(store: Any, body: bytes, encoding: str, content_type: str, header_rollout: str | None,
            limit: int) -> None:
    """Decompress, parse, build and store the spans of one export request (CPU work: off the event loop)."""
    body = _decompress(body, encoding, limit)
    try:
        batch = SpanBatch.from_dicts(request_rows(parse_request(body, content_type), header_rollout))
        store.insert_spans(batch)
    except ValueError as e:
        raise bad_request(str(e)) from e
    except DataError as e:  # a value PostgreSQL refuses that the checks above missed: still the client's
        raise bad_request(f"the store refused a value: {str(e.orig).splitlines()[0]}") from e


# null is the field's default, as in proto3's JSON mapping
_ANY_OBJECTS = {"type": ["array", "null"], "items": {"type": "object"}}
_SPAN = {"type": "object", "required": ["traceId", "spanId"], "properties": {
    "traceId": {"type": "string", "pattern": "^[0-9a-fA-F]{32}$"},
    "spanId": {"type": "string", "pattern": "^[0-9a-fA-F]{16}$"},
    "parentSpanId": {"type": ["string", "null"], "pattern": "^([0-9a-fA-F]{16})?$"},
    "name": {"type": ["string", "null"]}, "attributes": _ANY_OBJECTS, "events": _ANY_OBJECTS}}
OTLP_JSON = {"type": "object", "properties": {"resourceSpans": {"type": ["array", "null"], "items": {
    "type": "object", "properties": {"scopeSpans": {"type": ["array", "null"], "items": {
        "type": "object", "properties": {"spans": {"type": ["array", "null"], "items": _SPAN}}}}}}}}}
"""OTLP/JSON's ExportTraceServiceRequest, as far as the fields this route reads (ids in hex; a null list is
an empty one, as in proto3's JSON mapping)."""
_OTLP_BODY = {"required": True, "content": {
    "application/x-protobuf": {"schema": {"type": "string", "format": "binary",
                                          "description": "an ExportTraceServiceRequest message"}},
    "application/json": {"schema": OTLP_JSON}}}
_OTLP_OK = {200: {"description": "An ExportTraceServiceResponse, in the request's encoding", "content": {
    "application/x-protobuf": {"schema": {"type": "string", "format": "binary"}},
    "application/json": {"schema": {"type": "object"}}}}}


@router.post("/v1/traces", openapi_extra={"requestBody": _OTLP_BODY},
             responses=_OTLP_OK | error_responses(400, 413, 415, 429))
async def ingest_traces(request: Request, store: StoreDep, limit: BodyLimitDep) -> Response:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in ("application/x-protobuf", "application/json"):
        raise OpenAIError(415, f"unsupported Content-Type {content_type!r}; OTLP/HTTP uses "
                          "application/x-protobuf or application/json")
    encoding = request.headers.get("content-encoding", "").strip().lower()
    body = await request.body()
    budget: ByteBudget | None = getattr(getattr(request.app.state, "admission", None), "otlp", None)
    need = len(body) if encoding in ("", "identity") else limit  # a compressed body may inflate to the limit
    if budget is not None and not budget.take(need):
        busy = OpenAIError(429, "too many OTLP bytes being ingested at once: retry shortly", code="too_many_requests")
        refused = error_response(429, busy.body())
        refused.headers["Retry-After"] = "1"
        return refused
    try:
        await run_in_threadpool(_ingest, store, body, encoding, content_type, request.headers.get("x-rollout-id"),
                                limit)
    finally:
        if budget is not None:
            budget.give(need)
    resp = ExportTraceServiceResponse()
    if content_type == "application/json":
        return Response(json_format.MessageToJson(resp), media_type="application/json")
    return Response(resp.SerializeToString(), media_type="application/x-protobuf")
