"""Stream writers' hand-built fast paths send the same bytes as the generic event builder, and a stream's
events of one moment leave as one body chunk (the bytes are those of the events, in order)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tracegym.gateway.proxy.call_context import CallContext, Prompt
from tracegym.gateway.proxy.reply_parts import sse_event
from tracegym.gateway.proxy.responses.request import chat_request, parse_responses
from tracegym.gateway.proxy.responses.stream import ResponsesStreamWriter

SVC = SimpleNamespace(upstream=SimpleNamespace(token_native=False), tokenizer=None, served_model="m")


def _writer() -> ResponsesStreamWriter:
    parsed = chat_request(parse_responses({"model": "m", "input": "hi"}), [])
    return ResponsesStreamWriter(SVC, parsed, CallContext("resp_abc", "r", None, None, False), Prompt(None))  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=1), min_size=1, max_size=5), st.booleans())
def test_text_delta_fast_path_equals_the_generic_event(texts: list[str], reasoning_first: bool) -> None:
    fast, slow = _writer(), _writer()
    if reasoning_first:
        fast._reasoning("think")
        slow._reasoning("think")
    for text in texts:
        got = fast._text(text)[-1]
        slow._text("")  # opens the message item as the fast writer did
        slow.seq = fast.seq - 1
        want = slow._ev("response.output_text.delta", item_id=slow.msg_id, output_index=slow.message_at,
                        content_index=0, delta=text, logprobs=[])
        assert got == want
        event = json.loads(got.split(b"\ndata: ", 1)[1])
        assert event["delta"] == text and event["sequence_number"] == fast.seq - 1
    done = fast._close_message()
    assert json.loads(done[0].split(b"\ndata: ", 1)[1])["text"] == "".join(texts)


def test_sse_event_shape() -> None:
    assert sse_event({"type": "x", "a": 1}) == b'event: x\ndata: {"type":"x","a":1}\n\n'


class _Ev:
    """A stand-in upstream event: a name, and whether more were received with it."""

    def __init__(self, name: str, more: bool = False) -> None:
        self.name, self.more = name, more


class _Writer:
    """An ``EventWriter`` that names its events by what made them."""

    on_done = None

    def __init__(self) -> None:
        self.recorded: list[str | None] = []

    def opening(self) -> list[bytes]:
        return [b"open1 ", b"open2 "]

    def on_event(self, ev: _Ev) -> list[bytes]:
        return [] if ev.name == "quiet" else [f"{ev.name}.a ".encode(), f"{ev.name}.b ".encode()]

    def closing(self) -> list[bytes]:
        return [b"close1 ", b"close2"]

    def error_events(self, e: object) -> list[bytes]:
        return [b"err"]

    def record(self, error: str | None) -> None:
        self.recorded.append(error)


def _chunks(first: _Ev, rest: list[_Ev]) -> tuple[list[bytes], _Writer]:
    import asyncio

    from tracegym.gateway.proxy.streaming import sse_stream

    async def upstream() -> AsyncIterator[_Ev]:
        for ev in rest:
            yield ev

    async def collect() -> list[bytes]:
        return [chunk async for chunk in sse_stream(writer, first, upstream(), 10.0)]  # type: ignore[arg-type]

    writer = _Writer()
    return asyncio.run(collect()), writer


def test_events_of_one_moment_are_one_chunk() -> None:
    chunks, writer = _chunks(_Ev("e1"), [_Ev("e2"), _Ev("quiet"), _Ev("e3")])
    assert chunks == [b"open1 open2 e1.a e1.b ", b"e2.a e2.b ", b"e3.a e3.b ", b"close1 close2"]
    assert writer.recorded == [None]


def test_events_received_together_are_one_chunk() -> None:
    chunks, _ = _chunks(_Ev("e1", more=True), [_Ev("e2", more=True), _Ev("e3"), _Ev("e4", more=True), _Ev("e5")])
    assert chunks == [b"open1 open2 e1.a e1.b e2.a e2.b e3.a e3.b ", b"e4.a e4.b e5.a e5.b ", b"close1 close2"]
    chunks, _ = _chunks(_Ev("e1"), [_Ev("e2", more=True)])  # received with the stream's end: sent with its end
    assert chunks == [b"open1 open2 e1.a e1.b ", b"e2.a e2.b close1 close2"]
    chunks, _ = _chunks(_Ev("e1", more=True), [])  # a whole reply in one read: one chunk, after the commit
    assert chunks == [b"open1 open2 e1.a e1.b close1 close2"]
