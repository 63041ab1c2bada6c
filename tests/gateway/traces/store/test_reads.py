"""The reads of stored calls (``traces.reads``, SQLite and PostgreSQL): CallRecords without the request
body and the assembly's ``TokenCall``s equal the default read, request-cutting is exact or falls back, and
events of many rollouts come in one call."""

from __future__ import annotations

import orjson
import pytest
import sqlalchemy as sa

from tests.gateway.helpers import make_record
from tracegym.gateway.traces.call_spans import CHOICES, REQUEST, call_record_store_row, insert_call_records
from tracegym.gateway.traces.codec import decode
from tracegym.gateway.traces.reads import (
    attributes_without_request,
    call_record,
    iter_token_calls,
    list_call_records,
    list_call_records_many,
    list_spans,
    recent_call_records,
)
from tracegym.gateway.traces.store import Store
from tracegym.gateway.traces.store.schema import spans as S
from tracegym.gateway.traces.store.span_rows import COLUMNS, json_text
from tracegym.gateway.traces.token_calls import TokenCall, token_calls
from tracegym.types import CallRecord

TRICKY = ',"tracegym.choices":[{"x":1}],"tracegym.request":{"y":2}'


def _token_dict(call: TokenCall) -> dict:
    """A ``TokenCall``'s fields with its blobs decoded (lists) and their type tags."""
    d = {name: getattr(call, name) for name in TokenCall.__struct_fields__
         if name not in ("choices", "prompt")}
    d["prompt"] = decode(call.prompt)
    d["choices"] = [{"index": ch.index, "output": decode(ch.output), "logprobs": decode(ch.logprobs),
                     "versions": ch.versions} for ch in call.choices]
    d["tags"] = {b[:1] for b in [call.prompt, *(ch.output for ch in call.choices)] if b is not None}
    return d


def _token_calls(store: Store, ids: list[str]) -> dict[str, list[dict]]:
    return {rid: [_token_dict(c) for c in calls] for rid, calls in iter_token_calls(store, ids)}


def _records() -> list[CallRecord]:
    recs = [
        make_record(0),
        make_record(1, n=3),
        make_record(2, status="error", error="boom", first_token_time_ns=None),
        make_record(3, prompt_ids=None, retokenized=True, weight_version=None, agent_name=None),
        make_record(0, rollout_id="ro-2"),
        make_record(1, rollout_id="ro-2", prompt_ids=[2**40, 5]),  # int64 ids in one call of ro-2
    ]
    recs[3].choices[0].output_ids = None
    recs[3].choices[0].output_logprobs = None
    # a request holding the very keys and texts the request cut looks for
    recs[0].request["messages"][0]["content"] = TRICKY + ' \\",' + TRICKY.replace('"', '\\"')
    recs[0].request["extra_body"] = {"tracegym.choices": [1], "tracegym.request": {"z": [TRICKY]}}
    return recs


def test_reads_without_request_and_token_calls_equal_the_default_read(store: Store):
    recs = _records()
    insert_call_records(store, recs)
    ids = ["ro-1", "ro-2", "ro-none"]
    full = list_call_records_many(store, ids)
    fast = list_call_records_many(store, ids, with_request=False)
    assert full.keys() == fast.keys() == {"ro-1", "ro-2"}
    assert [c.to_dict() for c in full["ro-1"]] == [r.to_dict() for r in recs[:4]]
    for rid in full:
        assert [c.to_dict() for c in fast[rid]] == [{**f.to_dict(), "request": {}} for f in full[rid]]
    tokens = _token_calls(store, ids)
    assert list(tokens) == ids and tokens["ro-none"] == []
    for rid in full:  # the same calls, as the assembly reads them
        assert tokens[rid] == [_token_dict(c) for c in token_calls(full[rid])]
    assert {t for c in tokens["ro-1"] for t in c["tags"]} == {b"i"}
    # one int64 prompt makes every id blob of its rollout int64 (blobs of one type compare as bytes)
    assert {t for c in tokens["ro-2"] for t in c["tags"]} == {b"q"}
    assert [c["prompt"] for c in tokens["ro-2"]] == [r.prompt_ids for r in recs[4:]]


def test_recent_call_records_are_the_latest_calls_in_start_order(store: Store):
    recs = [make_record(i, start_time_ns=1_700_000_000_000_000_000 + (7 - i) * 1000) for i in range(8)]
    recs.append(make_record(9, rollout_id="ro-other"))
    insert_call_records(store, recs)
    store.insert_spans([{"trace_id": "t" * 32, "span_id": "a" * 16, "rollout_id": "ro-1", "source": "otlp",
                         "name": "tool", "start_time_ns": 2_000_000_000_000_000_000,
                         "end_time_ns": 2_000_000_000_000_000_001, "attributes": {}}])  # the agent's own span
    by_start = sorted(recs[:8], key=lambda r: r.start_time_ns)
    got = recent_call_records(store, "ro-1", 3)
    assert [c.to_dict() for c in got] == [r.to_dict() for r in by_start[-3:]]
    assert [c.call_id for c in recent_call_records(store, "ro-1", 100)] == [r.call_id for r in by_start]
    assert recent_call_records(store, "ro-none", 3) == []


def test_token_calls_refuse_blobs_that_do_not_match_their_choices(store: Store):
    insert_call_records(store, [make_record(0), make_record(1, n=2)])
    with store.db.write() as conn:  # one id too few in the n=1 call, an odd byte in the n=2 call's logprobs
        conn.execute(S.update().where(S.c.call_id == "chatcmpl-0-0").values(output_ids=sa.func.substr(
            S.c.output_ids, 1, sa.func.length(S.c.output_ids) - 4)))
    with pytest.raises(ValueError, match="shorter than the choices"):
        next(iter_token_calls(store, ["ro-1"]))
    with store.db.write() as conn:
        conn.execute(S.delete().where(S.c.call_id == "chatcmpl-0-0"))
        conn.execute(S.update().values(output_logprobs=sa.func.substr(S.c.output_logprobs, 1, 6)))
    with pytest.raises(ValueError, match="whole number"):
        next(iter_token_calls(store, ["ro-1"]))


def test_token_calls_skip_agent_spans_and_refuse_malformed_call_attributes(store: Store):
    agent_span = {"trace_id": "a" * 32, "span_id": "b" * 16, "name": "tool search", "source": "otlp",
                  "start_time_ns": 1, "end_time_ns": 2, "rollout_id": "ro-1",
                  "attributes": {"tracegym.rollout_id": "ro-1", "tool.name": "search", CHOICES: [1]}}
    assert store.insert_spans([agent_span]) == 1
    insert_call_records(store, [make_record(0)])
    [(_, calls)] = iter_token_calls(store, ["ro-1"])
    assert [c.call_id for c in calls] == ["chatcmpl-0-0"]  # the agent's span is no call
    with store.db.write() as conn:  # a call whose choice index is no number
        attrs = conn.execute(sa.select(S.c.attributes).where(S.c.call_id == "chatcmpl-0-0")).scalar_one()
        attrs[CHOICES][0]["index"] = "first"
        conn.execute(S.update().where(S.c.call_id == "chatcmpl-0-0").values(attributes=attrs))
    with pytest.raises(ValueError, match="bad LLM call span in rollout 'ro-1'"):
        next(iter_token_calls(store, ["ro-1"]))


def _old_layout(attrs: dict, request: dict) -> dict:
    """Attributes as the store kept them before migration 0003: the request body inside, right before
    the choices (the gateway's key order then)."""
    out = {}
    for k, v in attrs.items():
        if k == CHOICES:
            out[REQUEST] = request
        out[k] = v
    return out


def _old_stored_attributes(rec: CallRecord) -> str:
    row = call_record_store_row(rec, trace_id="t" * 32, span_id="s" * 16, resource_json="null",
                                start_time_ns=1, end_time_ns=2)
    assert COLUMNS[12] == "attributes" and COLUMNS[-1] == "request"
    assert REQUEST not in orjson.loads(row[12]) and orjson.loads(row[-1]) == rec.request  # today's layout
    return json_text(_old_layout(orjson.loads(row[12]), rec.request))


def test_request_cut_is_exact_or_declines():
    rec = _records()[0]
    text = _old_stored_attributes(rec)
    full = orjson.loads(text)
    for form in (text, text.encode()):
        cut = attributes_without_request(form)
        assert cut == {**full, REQUEST: {}}
    # another writer's key order (choices before the request): declined, the full parse is used instead
    reordered = {CHOICES: full[CHOICES], **{k: v for k, v in full.items() if k != CHOICES}}
    assert attributes_without_request(json_text(reordered)) is None
    assert attributes_without_request(json_text({k: v for k, v in full.items() if k != REQUEST})) is None


def _reads(store: Store, ids: list[str]) -> tuple:
    full = list_call_records_many(store, ids)
    fast = list_call_records_many(store, ids, with_request=False)
    spans = {rid: list_spans(store, rid) for rid in ids}
    return ({k: [c.to_dict() for c in v] for k, v in full.items()},
            {k: [c.to_dict() for c in v] for k, v in fast.items()}, _token_calls(store, ids), spans)


def test_rows_from_before_the_request_column_read_the_same(store: Store):
    """Call spans keep their request body in the ``request`` column; rows written before it existed (the
    body inside ``attributes``, ``request`` NULL) give the same records and span dicts on every read."""
    recs = _records()
    insert_call_records(store, recs)
    ids = ["ro-1", "ro-2"]
    before = _reads(store, ids)
    assert [c["request"] for c in before[0]["ro-1"]] == [r.request for r in recs[:4]]
    assert all(REQUEST in s["attributes"] for spans in before[3].values() for s in spans)
    with store.db.write() as conn:
        rows = conn.execute(sa.select(S.c.id, S.c.attributes, S.c.request)).all()
        assert rows and all(r.request is not None and REQUEST not in r.attributes for r in rows)
        for r in rows:  # rewrite each row as the store wrote it before migration 0003
            conn.execute(S.update().where(S.c.id == r.id).values(
                attributes=_old_layout(r.attributes, orjson.loads(r.request)), request=None))
    with store.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(S.c.request.is_not(None))).scalar_one() == 0
    assert _reads(store, ids) == before
def test_events_of_many_rollouts(store: Store):
    store.add_reward("ro-a", 1.0, idempotency_key="k1")
    store.add_event("ro-a", kind="event", idempotency_key="k2", value={"ok": True})
    store.add_reward("ro-b", 0.5, idempotency_key="k1", name="step", call_index=0)
    store.add_reward("ro-a", 0.25, idempotency_key="k3", name="late")
    many = store.list_events_many(["ro-a", "ro-b", "ro-c"], kind="reward")
    assert many == {rid: store.list_events(rid, kind="reward") for rid in ("ro-a", "ro-b")}
    assert [e["value"] for e in many["ro-a"]] == [1.0, 0.25]
    assert store.list_events_many(["ro-a"]) == {"ro-a": store.list_events("ro-a")}
    with pytest.raises(ValueError, match="event kind"):
        store.list_events_many(["ro-a"], kind="nope")


def test_token_calls_assemble_to_the_same_trajectory_json(store: Store):
    from tracegym.gateway.api.trajectories import trajectory_json
    from tracegym.gateway.traces.assembly import assemble, check_invariants

    prompt, recs = [1, 2, 3], []
    for i in range(4):
        rec = make_record(i, prompt_ids=list(prompt))
        recs.append(rec)
        prompt = prompt + rec.choices[0].output_ids + [7, 8]
    insert_call_records(store, recs)
    lists = list_call_records(store, "ro-1")
    [(_, tokens)] = iter_token_calls(store, ["ro-1"])
    assert all(type(c) is TokenCall for c in tokens)
    a, b = assemble(lists, rollout_id="ro-1"), assemble(tokens, rollout_id="ro-1")
    check_invariants(tokens, b)
    check_invariants(lists, b)
    assert len(b.sequences) == 1 and trajectory_json(a) == trajectory_json(b) == orjson.dumps(b.to_dict())


def test_one_call_is_read_by_its_id(store: Store) -> None:
    recs = [make_record(i, rollout_id="ro-a") for i in range(3)] + [make_record(9, rollout_id="ro-b")]
    insert_call_records(store, recs)
    by_rollout = {r.call_id: r for rid in ("ro-a", "ro-b") for r in list_call_records(store, rid)}
    for rec in recs:
        assert call_record(store, rec.call_id) == by_rollout[rec.call_id]
    assert call_record(store, "no-such-call") is None
