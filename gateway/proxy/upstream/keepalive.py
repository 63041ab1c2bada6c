"""A minimal HTTP/1.1 keep-alive client for the hot upstream calls: a JSON ``POST`` answered by a JSON
body (SGLang ``/generate``) or by a body read as it arrives (``/generate`` streaming its events).

Why not aiohttp here: its per-request machinery (tracing hooks, cookie jar, multidict headers, timer
contexts, payload objects) was the largest single cost of a proxied call in the gateway profile
(``benchmarks/gateway_overhead.py``). This is an ``asyncio.Protocol`` with the httptools parser (what
uvicorn already uses) over a pool of idle connections. Everything else (health, control calls) stays
on aiohttp.

Errors are the gateway's: connect failure → ``UpstreamUnavailable`` ("unreachable"), silence past the
read timeout → ``UpstreamTimeout``, a dropped connection → ``UpstreamUnavailable``. A request is retried
once on a new connection only when a *reused* idle connection turns out closed before the request was
written or before any response byte arrived with the peer closing (the server's keep-alive expiry race);
idle connections are dropped after ``idle_timeout`` (below uvicorn's default keep-alive of 5 s) so that
race is rare. A streamed body is read chunk by chunk (``StreamedBody.read``): the read timeout bounds each
wait for the next chunk, not the whole body, and the connection stops reading from the socket while more
than ``STREAM_BUFFER_BYTES`` wait unread."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

from tracegym.gateway.openai_errors import UpstreamTimeout, UpstreamUnavailable

STREAM_BUFFER_BYTES = 1 << 18
"""Unread bytes of a streamed body past which its connection stops reading from the socket."""


class _StaleConnection(ConnectionError):
    """A reused connection closed before answering: safe to retry on a new one."""


class _Conn(asyncio.Protocol):
    __slots__ = ("body", "broken", "buffered", "closed", "ended", "framed", "got_bytes", "headers_done",
                 "idle_since", "keep_alive", "parser", "paused", "reader", "status", "streaming", "transport",
                 "waiter")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.status = 0
        self.body: list[bytes] = []
        self.keep_alive = True
        self.closed = False
        self.got_bytes = False
        self.idle_since = 0.0
        self.headers_done = False
        self.framed = False  # Content-Length or chunked (else the body ends when the peer closes)
        self.streaming = False  # the waiter resolves with the head; body chunks wait in ``body`` for ``reader``
        self.ended = False  # the whole streamed body arrived
        self.broken: ConnectionError | None = None  # the connection was lost before a streamed body ended
        self.reader: asyncio.Future[None] | None = None  # a streamed body's reader, waiting for a chunk
        self.buffered = 0
        self.paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"invalid HTTP response: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.streaming and self.headers_done:
            if not self.ended:
                self.ended = not self.framed  # an unframed body ends when the peer closes
                if not self.ended:
                    self.broken = ConnectionError(f"connection lost mid-response: {exc or 'closed by peer'}")
                self._wake(self.broken)
            return
        if self.waiter is not None and not self.waiter.done():
            if self.headers_done and not self.framed:
                self.waiter.set_result((self.status, b"".join(self.body)))
            elif not self.got_bytes:
                self._fail(_StaleConnection("connection closed before the response"))
            else:
                self._fail(ConnectionError(f"connection lost mid-response: {exc or 'closed by peer'}"))

    # -- httptools callbacks
    def on_header(self, name: bytes, _value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.streaming and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.status, b""))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        if self.streaming:
            self.buffered += len(body)
            if self.buffered > STREAM_BUFFER_BYTES and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
            self._wake(None)

    def on_message_complete(self) -> None:
        if self.streaming:
            self.ended = True
            self._wake(None)
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.status, b"".join(self.body)))

    def _wake(self, exc: Exception | None) -> None:
        """Wake a streamed body's waiting reader (with ``exc`` when the body broke)."""
        if self.reader is not None and not self.reader.done():
            if exc is None:
                self.reader.set_result(None)
            else:
                self.reader.set_exception(exc)

    # -- use
    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def start(self, request: bytes, loop: asyncio.AbstractEventLoop,
              streaming: bool = False) -> asyncio.Future[tuple[int, bytes]]:
        """Send ``request``; the future resolves with ``(status, body)``, or with ``(status, b"")`` once the
        head arrived when ``streaming`` (the body is then read with ``StreamedBody``)."""
        self.waiter = loop.create_future()
        self.body = []
        self.status = 0
        self.got_bytes = self.headers_done = self.framed = self.ended = self.paused = False
        self.streaming, self.buffered, self.reader, self.broken = streaming, 0, None, None
        self.transport.write(request)  # type: ignore[union-attr]
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class KeepAlivePool:
    """Keep-alive connections to one ``http://host:port``; ``post_json(path, body)`` → (status, bytes).
    Owned by the upstream adapter (closed with it); used from one event loop."""

    def __init__(self, base_url: str, *, connect_timeout: float, read_timeout: float,
                 max_idle: int = 256, idle_timeout: float = 4.0, api_key: str | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"KeepAlivePool takes an http://host[:port] URL, got {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self._prefix = u.path.rstrip("/")
        self._host_header = f"{self.host}:{self.port}" if u.port else self.host
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self._idle: deque[_Conn] = deque()
        self._closed = False
        self._auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""

    def _head(self, path: str, length: int) -> bytes:
        return (f"POST {self._prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                f"Content-Type: application/json\r\nAccept: application/json\r\n{self._auth}"
                f"Content-Length: {length}\r\n\r\n").encode("latin-1")

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Conn:
        url = f"http://{self._host_header}{self._prefix}"
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(_Conn, self.host, self.port)
        except TimeoutError as e:
            raise UpstreamUnavailable(f"upstream {url} is unreachable: connect timed out") from e
        except OSError as e:
            raise UpstreamUnavailable(f"upstream {url} is unreachable: {e}") from e
        return conn

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # most recently used first
            if not conn.closed and now - conn.idle_since < self.idle_timeout:
                return conn
            conn.close()
        return None

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``(status, body)`` of a JSON ``POST``."""
        _, status, data = await self._request(path, body, streaming=False)
        return status, data

    async def post_stream(self, path: str, body: bytes) -> StreamedBody:
        """A JSON ``POST`` whose answer is read as it arrives: returned once its head is here."""
        conn, status, _ = await self._request(path, body, streaming=True)
        return StreamedBody(self, conn, status)

    async def _request(self, path: str, body: bytes, *, streaming: bool) -> tuple[_Conn, int, bytes]:
        if self._closed:
            raise UpstreamUnavailable("upstream client is closed")
        loop = asyncio.get_running_loop()
        request = self._head(path, len(body)) + body
        conn = self._take_idle()
        if conn is not None:
            try:
                return conn, *await self._exchange(conn, request, loop, streaming)
            except _StaleConnection:
                pass  # the server closed it while idle: nothing was processed, use a new connection
        conn = await self._connect(loop)
        try:
            return conn, *await self._exchange(conn, request, loop, streaming)
        except _StaleConnection as e:
            raise UpstreamUnavailable(f"upstream {self.host}:{self.port} failed: {e}") from e

    async def _exchange(self, conn: _Conn, request: bytes, loop: asyncio.AbstractEventLoop,
                        streaming: bool = False) -> tuple[int, bytes]:
        """``(status, body)``; when ``streaming``, ``(status, b"")`` once the head arrived, and the
        connection is the caller's ``StreamedBody``'s until it is released."""
        fut = conn.start(request, loop, streaming)
        timer = loop.call_later(self.read_timeout, conn._fail, TimeoutError())
        try:
            status, data = await fut
        except _StaleConnection:
            conn.close()
            raise
        except TimeoutError as e:
            conn.close()
            raise UpstreamTimeout(
                f"upstream {self.host}:{self.port} did not answer within {self.read_timeout:g}s") from e
        except ConnectionError as e:
            conn.close()
            raise UpstreamUnavailable(f"upstream {self.host}:{self.port} failed: {e}") from e
        except BaseException:  # cancelled (client went away): the connection is mid-request, drop it
            conn.close()
            raise
        finally:
            timer.cancel()
            conn.waiter = None
        if not streaming:
            self.release(conn)
        return status, data

    def release(self, conn: _Conn) -> None:
        """Keep ``conn`` for the next request if its exchange ended cleanly and it may be kept, else close it."""
        if conn.keep_alive and not conn.closed and not self._closed and len(self._idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()


class StreamedBody:
    """The body of a ``post_stream`` answer, read chunk by chunk; ``finish`` hands the connection back."""

    __slots__ = ("_conn", "_done", "_pool", "status")

    def __init__(self, pool: KeepAlivePool, conn: _Conn, status: int) -> None:
        self._pool, self._conn, self.status = pool, conn, status
        self._done = False

    async def read(self) -> bytes:
        """The bytes that arrived since the last read, waiting for some; ``b""`` once the body has ended.
        Waiting longer than the read timeout for the next bytes raises ``UpstreamTimeout``, a connection
        lost mid-body ``UpstreamUnavailable``."""
        conn = self._conn
        while not conn.body:
            if conn.ended:
                return b""
            if conn.broken is not None:
                raise UpstreamUnavailable(f"upstream {self._pool.host}:{self._pool.port} failed: {conn.broken}")
            loop = asyncio.get_running_loop()
            conn.reader = loop.create_future()
            timer = loop.call_later(self._pool.read_timeout, conn._wake, TimeoutError())
            try:
                await conn.reader
            except TimeoutError as e:
                raise UpstreamTimeout(f"upstream {self._pool.host}:{self._pool.port} did not send more within "
                                      f"{self._pool.read_timeout:g}s") from e
            except ConnectionError as e:
                raise UpstreamUnavailable(f"upstream {self._pool.host}:{self._pool.port} failed: {e}") from e
            finally:
                timer.cancel()
                conn.reader = None
        data = b"".join(conn.body) if len(conn.body) > 1 else conn.body[0]
        conn.body.clear()
        conn.buffered = 0
        if conn.paused and conn.transport is not None:
            conn.paused = False
            conn.transport.resume_reading()
        return data

    def finish(self) -> None:
        """The connection goes back to the pool if the whole body was read, else it is closed (the rest of
        the answer would be read by the next request)."""
        if self._done:
            return
        self._done = True
        if self._conn.ended and not self._conn.body:
            self._pool.release(self._conn)
        else:
            self._conn.close()
