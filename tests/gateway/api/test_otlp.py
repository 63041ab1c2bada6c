"""OTLP/HTTP ingest with the real ``opentelemetry-exporter-otlp-proto-http`` exporter against a live uvicorn
server: spans of an already-instrumented agent land in the store, linked to rollouts."""

from __future__ import annotations

import gzip

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from tests.gateway.helpers import make_app, serve
from tracegym.gateway.traces.codec import encode_ints
from tracegym.gateway.traces.reads import list_call_records, list_spans
from tracegym.gateway.traces.store import Store


@pytest.fixture
def live(store_url: str):
    store = Store.open(store_url)
    with serve(make_app(store)) as url:
        yield store, url
    store.close()


def _provider(url: str, *, resource: dict | None = None, headers: dict | None = None,
              compression: Compression = Compression.NoCompression) -> TracerProvider:
    tp = TracerProvider(resource=Resource.create({"service.name": "my-agent", **(resource or {})}),
                        shutdown_on_exit=False)
    exporter = OTLPSpanExporter(endpoint=f"{url}/v1/traces", headers=headers, compression=compression)
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    return tp


def test_real_exporter_spans_link_to_rollouts(live):
    store, url = live
    tp = _provider(url, headers={"X-Rollout-Id": "ro-header"})
    tracer = tp.get_tracer("agent")
    tool_attrs = {"query": "x", "hits": [1, 2], "tracegym.rollout_id": "ro-attr"}
    with (
        tracer.start_as_current_span("agent.run", attributes={"tracegym.rollout_id": "ro-attr"}) as parent,
        tracer.start_as_current_span("tool.search", attributes=tool_attrs) as child,
    ):
        child.add_event("cache-miss", {"key": "k"})
        child.set_status(Status(StatusCode.ERROR, "timeout"))
    with tracer.start_as_current_span("unlabelled"):
        pass
    tp.shutdown()

    spans = list_spans(store, "ro-attr")
    assert [s["name"] for s in spans] == ["agent.run", "tool.search"]
    run, tool = spans
    assert tool["parent_span_id"] == format(parent.get_span_context().span_id, "016x")
    assert tool["trace_id"] == run["trace_id"] == format(parent.get_span_context().trace_id, "032x")
    assert tool["source"] == "otlp" and tool["kind"] == "internal"
    assert tool["status"] == "error" and tool["status_message"] == "timeout"
    assert tool["attributes"]["hits"] == [1, 2] and tool["attributes"]["otel.scope.name"] == "agent"
    assert tool["events"][0]["name"] == "cache-miss" and tool["events"][0]["attributes"] == {"key": "k"}
    assert tool["resource"]["service.name"] == "my-agent"
    assert tool["choices"] is None and tool["prompt_ids"] is None
    header = list_spans(store, "ro-header")
    assert [s["name"] for s in header] == ["unlabelled"]  # no attribute: the header links it
    assert store.get_rollout("ro-attr")["status"] == "adhoc"

    r = httpx.get(f"{url}/api/rollouts/ro-attr/spans")
    assert r.status_code == 200 and [s["name"] for s in r.json()["spans"]] == ["agent.run", "tool.search"]


def test_resource_attribute_and_gzip_and_token_arrays(live):
    store, url = live
    tp = _provider(url, resource={"tracegym.rollout_id": "ro-res"}, compression=Compression.Gzip)
    tracer = tp.get_tracer("agent")
    with tracer.start_as_current_span("llm", attributes={
        "tracegym.prompt_token_ids": [5, 6, 7],  # plain arrays from a foreign instrumentation
        "tracegym.output_token_ids": encode_ints([8, 9]),  # or tracegym's compact bytes
        "blob": b"\x00\x01",
    }):
        pass
    tp.shutdown()
    [span] = list_spans(store, "ro-res")
    assert span["prompt_ids"] == [5, 6, 7]
    assert span["attributes"]["blob"] == "AAE="  # other bytes are kept as base64 text


def test_otlp_json_and_bad_input(live):
    store, url = live
    body = {"resourceSpans": [{"resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": "js-agent"}}]},
        "scopeSpans": [{"scope": {"name": "s"}, "spans": [{
            "traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
            "name": "json-span", "kind": 3, "startTimeUnixNano": "1700000000000000000",
            "endTimeUnixNano": "1700000000500000000",
            "attributes": [{"key": "tracegym.rollout_id", "value": {"stringValue": "ro-json"}},
                           {"key": "n", "value": {"intValue": "3"}}],
            "status": {"code": 1}}]}]}]}
    r = httpx.post(f"{url}/v1/traces", json=body)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/traces", json=body)  # a retry stores nothing new
    assert r.status_code == 200
    [span] = list_spans(store, "ro-json")
    assert span["kind"] == "client" and span["status"] == "ok" and span["attributes"]["n"] == 3
    assert span["trace_id"] == "5b8efff798038103d269b633813fc60c" and span["end_time_ns"] == 1700000000500000000

    bad = httpx.post(f"{url}/v1/traces", content=b"\xff\xfenot protobuf",
                     headers={"content-type": "application/x-protobuf"})
    assert bad.status_code == 400 and "protobuf" in bad.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/traces", content=b"{", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    bad = httpx.post(f"{url}/v1/traces", content=b"x", headers={"content-type": "text/plain"})
    assert bad.status_code == 415
    bad = httpx.post(f"{url}/v1/traces", content=gzip.compress(b"x")[:5],
                     headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"})
    assert bad.status_code == 400


def _any_value(v) -> dict:
    import base64

    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, bytes):
        return {"bytesValue": base64.b64encode(v).decode()}
    if isinstance(v, list | tuple):
        return {"arrayValue": {"values": [_any_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _call_span_body(attrs: dict, span_id: str = "eee19b7ec3c1b174", name: str = "chat m") -> dict:
    return {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"scope": {"name": "s"}, "spans": [{
        "traceId": "5b8efff798038103d269b633813fc60c", "spanId": span_id, "name": name, "kind": 3,
        "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000500000000",
        "attributes": [{"key": k, "value": _any_value(v)} for k, v in attrs.items()]}]}]}]}


def test_call_spans_that_later_reads_cannot_rebuild_are_400(live):
    """An OTLP span with the LLM call keys is read back as a CallRecord by every trajectory read of its
    rollout: one that cannot be rebuilt is refused at ingest, not stored to break those reads."""
    from tests.gateway.helpers import make_record
    from tracegym.gateway.traces.call_spans import call_record_attributes
    from tracegym.gateway.traces.codec import encode_floats

    store, url = live
    good = call_record_attributes(make_record(0, rollout_id="ro-call"))
    bad_cases = [
        ({k: v for k, v in good.items() if k != "gen_ai.operation.name"}, "gen_ai.operation.name"),
        ({k: v for k, v in good.items() if k != "gen_ai.request.model"}, "gen_ai.request.model"),
        (good | {"tracegym.output_token_ids": encode_floats([0.5] * 7)}, "tagged i or q"),
        (good | {"tracegym.output_logprobs": encode_ints([1] * 7)}, "tagged f or d"),
        (good | {"tracegym.prompt_token_ids": b"i\x01\x00\x00"}, "multiple"),  # 3 bytes: not an int32
        (good | {"tracegym.prompt_token_ids": b"z\x01"}, "tag"),
        (good | {"tracegym.output_token_ids": encode_ints([1, 2])}, "shorter"),  # choices say 7 ids
        (good | {"tracegym.choices": '[{"finish_reason": "stop"}]'}, "index"),
        (good | {"tracegym.choices": "[1]"}, "bad LLM call span"),
        (good | {"tracegym.agent_name": 5}, "agent_name"),
        (good | {"tracegym.rollout_id": "r" * 201}, "201 characters"),
    ]
    for attrs, message in bad_cases:
        r = httpx.post(f"{url}/v1/traces", json=_call_span_body(attrs))
        assert r.status_code == 400, (message, r.text)
        assert message in r.json()["error"]["message"], (message, r.text)
    assert store.list_rollouts()[0] == []  # nothing of the refused requests was stored

    r = httpx.post(f"{url}/v1/traces", json=_call_span_body(good))
    assert r.status_code == 200, r.text
    [rec] = list_call_records(store, "ro-call")
    assert rec.to_dict() == make_record(0, rollout_id="ro-call").to_dict() | {
        "start_time_ns": 1700000000000000000, "end_time_ns": 1700000000500000000}
    spans = httpx.get(f"{url}/api/rollouts/ro-call/spans").json()["spans"]
    assert spans[0]["source"] == "otlp" and spans[0]["choices"][0]["output_ids"] == rec.choices[0].output_ids


def test_an_overlong_value_is_400_not_a_lost_batch(live):
    store, url = live
    body = _call_span_body({"tracegym.rollout_id": "ro-fine"}, name="x" * 501)
    r = httpx.post(f"{url}/v1/traces", json=body)
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/traces", json=_call_span_body({"tracegym.rollout_id": "ro-fine"}))
    assert r.status_code == 200 and len(list_spans(store, "ro-fine")) == 1
    r = httpx.post(f"{url}/v1/traces", json=_call_span_body({}, span_id="eee19b7ec3c1b175"),
                   headers={"X-Rollout-Id": "h" * 201})
    assert r.status_code == 400 and "rollout_id" in r.json()["error"]["message"]


@pytest.mark.parametrize("body", [b'"AAA"', b"[]", b'{"resourceSpans": ["AAA"]}',
                                  b'{"resourceSpans": [{"scopeSpans": [{"spans": [1]}]}]}',
                                  b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"events": ["AAA"]}]}]}]}',
                                  b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"attributes": [1]}]}]}]}'])
def test_otlp_json_of_the_wrong_shape_is_refused(body: bytes) -> None:
    """protobuf's JSON parser took a string for the request and for a ResourceSpans (the fuzzer's finding:
    200 for a body that is no export request)."""
    from tracegym.gateway.api.otlp import parse_request

    with pytest.raises(ValueError, match="must be"):
        parse_request(body, "application/json")


def test_otlp_json_null_lists_are_empty() -> None:
    from tracegym.gateway.api.otlp import parse_request

    assert len(parse_request(b'{"resourceSpans": null}', "application/json").resource_spans) == 0
    req = parse_request(b'{"resourceSpans": [{"scopeSpans": [{"spans": null}]}]}', "application/json")
    assert len(req.resource_spans[0].scope_spans[0].spans) == 0
