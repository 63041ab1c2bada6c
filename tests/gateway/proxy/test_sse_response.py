"""``sse_response.SseResponse``: the last chunk carries the end of the body (no empty message after it), and
a client's disconnect cancels the stream where it waits, closes it (so it records the call) and ends the
response quietly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tracegym.gateway.proxy.sse_response import LastChunk, SseResponse


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def test_the_last_chunk_ends_the_body() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield LastChunk(b"data: [DONE]\n\n")

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(SseResponse(chunks())({"type": "http"}, _never_disconnects, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]


def test_the_head_waits_for_the_first_chunk() -> None:
    """The head and the first chunk are sent back to back (the server's protocol writes them as one)."""
    made: list[str] = []

    async def chunks() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.01)  # a reply waiting for its commit
        made.append("first")
        yield LastChunk(b"data: 1\n\ndata: [DONE]\n\n")

    sent: list[tuple[str, list[str]]] = []

    async def send(message: dict) -> None:
        sent.append((message["type"], list(made)))

    asyncio.run(SseResponse(chunks())({"type": "http"}, _never_disconnects, send))
    assert sent == [("http.response.start", ["first"]), ("http.response.body", ["first"])]


def test_an_empty_body_still_ends() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        return
        yield b""

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(SseResponse(chunks())({"type": "http"}, _never_disconnects, send))
    assert [(m["type"], m.get("more_body")) for m in sent] == [("http.response.start", None),
                                                               ("http.response.body", False)]


def test_a_body_without_a_last_chunk_still_ends() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(SseResponse(chunks())({"type": "http"}, _never_disconnects, send))
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"data: 1\n\n", True), (b"", False)]


def test_a_disconnect_closes_the_stream_where_it_waits() -> None:
    closed: list[str] = []
    gone = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            gone.set()
            await asyncio.sleep(30)  # an upstream that has more to say
            yield LastChunk(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            closed.append("cancelled")
            raise
        finally:
            closed.append("closed")

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def main() -> None:
        await asyncio.wait_for(SseResponse(chunks())({"type": "http"}, receive, send), 5)
        assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]

    asyncio.run(main())
    assert closed == ["cancelled", "closed"]
    assert [m.get("more_body") for m in sent] == [None, True]  # nothing sent after the client went away
