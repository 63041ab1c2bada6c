"""The HTTP response of a streamed call: ``SseResponse`` sends an async iterator's chunks as an SSE body,
the one marked ``LastChunk`` as the body's end, and cancels the stream when the client disconnects."""

from __future__ import annotations

import asyncio

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class LastChunk(bytes):
    """A stream body's last chunk: ``SseResponse`` sends it as the end of the body (with HTTP's chunked
    terminator, one write instead of two)."""


class SseResponse(StreamingResponse):
    """``text/event-stream`` from an async iterator of chunks, with three costs of Starlette's streaming
    response taken out: the head goes out with the first chunk, the end of the body with the last chunk
    when the iterator marks it (``LastChunk``), and the client's disconnect is watched by one plain task
    that cancels the stream (Starlette runs an anyio task group for it under ASGI 2.3, as uvicorn is). A
    disconnect cancels the iterator where it waits, which records the call (``sse_stream``), and ends the
    response quietly."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(cancel_on_disconnect(receive, task))
        try:
            # the head waits for the first chunk (ready at once in a stream that pulled its first event before
            # it started; the whole body of a reply received in one read), and both go out in one write
            first = await anext(aiter(self.body_iterator), None)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            ended = False
            if first is not None:
                ended = type(first) is LastChunk
                await send({"type": "http.response.body", "body": first, "more_body": not ended})
            async for chunk in self.body_iterator:
                ended = type(chunk) is LastChunk
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # not the client's disconnect (the server is shutting down)
            task.uncancel()
        finally:
            watcher.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def cancel_on_disconnect(receive: Receive, task: asyncio.Task) -> None:
    """Once a request's body is read, the server's ``receive`` returns only when the client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass
    task.cancel()
