"""Shared HTTP plumbing for the aiohttp-based adapters: one ``ClientSession`` per app (owned by the
lifespan), error mapping (connect failure → 502, silence past the timeout → 504), SSE line parsing.

Why aiohttp and not httpx: a proxy on ``httpx.AsyncClient`` degrades as concurrency rises, one on
``aiohttp.ClientSession`` does not (``benchmarks.gateway_overhead``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import orjson

from tracegym.gateway.openai_errors import OpenAIError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable

JSON_HEADERS = {"Content-Type": "application/json"}


def make_session(max_connections: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=max_connections, ttl_dns_cache=300)
    return aiohttp.ClientSession(connector=connector, json_serialize=lambda o: orjson.dumps(o).decode())


def request_timeout(read_timeout: float, connect_timeout: float) -> aiohttp.ClientTimeout:
    """No total limit (a long generation is fine); the upstream may not stay silent past ``read_timeout``."""
    return aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)


@contextmanager
def upstream_errors(url: str, timeout: float) -> Iterator[None]:
    """Turn aiohttp/asyncio failures into the gateway's 502/504 errors."""
    try:
        yield
    except OpenAIError:
        raise
    except TimeoutError as e:  # aiohttp.ServerTimeoutError is a TimeoutError
        raise UpstreamTimeout(f"upstream {url} did not answer within {timeout:g}s") from e
    except aiohttp.ClientConnectorError as e:
        raise UpstreamUnavailable(f"upstream {url} is unreachable: {e.os_error or e}") from e
    except (aiohttp.ClientError, ConnectionError) as e:
        raise UpstreamUnavailable(f"upstream {url} failed: {type(e).__name__}: {e}") from e


async def check_status(resp: aiohttp.ClientResponse) -> None:
    if resp.status >= 400:
        text = (await resp.read()).decode(errors="replace")[:1000]
        raise UpstreamRejected(resp.status, error_message(text))


async def read_all(read: Callable[[], Awaitable[bytes]], limit: int) -> str:
    """The text of a body read with ``read`` (``sse_events``'s reader) until its end, cut at ``limit``
    characters: an error answer's body."""
    parts = []
    while chunk := await read():
        parts.append(chunk)
    return b"".join(parts).decode(errors="replace")[:limit]


def error_message(text: str) -> str:
    """The message of an upstream's JSON error body (``{"error": {"message": ...}}`` and variants)."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
    return text


async def sse_events(read: Callable[[], Awaitable[bytes]]) -> AsyncIterator[tuple[Any, bool]]:
    """``(payload, more)``: the parsed JSON payloads of ``data:`` lines until ``[DONE]``, each with whether
    more events, or the stream's end, arrived in the same read from the socket (they are here already: a
    stream writer can send them together, one write instead of one per event). ``read`` returns the body's
    next bytes (``b""`` at its end): aiohttp's ``resp.content.readany`` or ``StreamedBody.read``. An
    ``{"error": ...}`` event raises."""
    rest = b""
    while True:
        chunk = await read()
        if chunk:
            *lines, rest = (rest + chunk).split(b"\n")
        else:  # the end of the body: what is left is the last line
            lines, rest = [rest], b""
        events, done = [], False
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = orjson.loads(data)
            if isinstance(event, dict) and "error" in event and len(event) == 1:
                raise UpstreamRejected(502, error_message(data.decode(errors="replace")))
            events.append(event)
        ended = done or not chunk
        last = len(events) - 1
        for i, event in enumerate(events):
            yield event, ended or i < last
        if ended:
            return


class BackgroundTasks:
    """Fire-and-forget tasks (aborts) kept referenced until done, cancelled on close."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, grace: float = 2.0) -> None:
        """Let pending tasks finish for up to ``grace`` seconds, then cancel the rest."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
