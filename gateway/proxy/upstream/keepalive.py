"""A minimal HTTP/1.1 keep-alive client for the one hot upstream call: a JSON ``POST`` answered by a
JSON body (SGLang ``/generate`` without streaming).

Why not aiohttp here: its per-request machinery (tracing hooks, cookie jar, multidict headers, timer
contexts, payload objects) was the largest single cost of a proxied call in the gateway profile
(``benchmarks/gateway_overhead.py``). This is an ``asyncio.Protocol`` with the httptools parser (what
uvicorn already uses) over a pool of idle connections. Everything else (streams, health, control
calls) stays on aiohttp.

Errors are the gateway's: connect failure → ``UpstreamUnavailable`` ("unreachable"), silence past the
read timeout → ``UpstreamTimeout``, a dropped connection → ``UpstreamUnavailable``. A request is retried
once on a new connection only when a *reused* idle connection turns out closed before the request was
written or before any response byte arrived with the peer closing (the server's keep-alive expiry race);
idle connections are dropped after ``idle_timeout`` (below uvicorn's default keep-alive of 5 s) so that
race is rare."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

from tracegym.gateway.openai_errors import UpstreamTimeout, UpstreamUnavailable


class _StaleConnection(ConnectionError):
    """A reused connection closed before answering: safe to retry on a new one."""


class _Conn(asyncio.Protocol):
    __slots__ = ("body", "closed", "framed", "got_bytes", "headers_done", "idle_since", "keep_alive", "parser",
                 "status", "transport", "waiter")

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

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.status, b"".join(self.body)))

    # -- use
    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def start(self, request: bytes, loop: asyncio.AbstractEventLoop) -> asyncio.Future[tuple[int, bytes]]:
        self.waiter = loop.create_future()
        self.body = []
        self.status = 0
        self.got_bytes = self.headers_done = self.framed = False
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
        if self._closed:
            raise UpstreamUnavailable("upstream client is closed")
        loop = asyncio.get_running_loop()
        request = self._head(path, len(body)) + body
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, request, loop)
            except _StaleConnection:
                pass  # the server closed it while idle: nothing was processed, use a new connection
        conn = await self._connect(loop)
        try:
            return await self._exchange(conn, request, loop)
        except _StaleConnection as e:
            raise UpstreamUnavailable(f"upstream {self.host}:{self.port} failed: {e}") from e

    async def _exchange(self, conn: _Conn, request: bytes, loop: asyncio.AbstractEventLoop) -> tuple[int, bytes]:
        fut = conn.start(request, loop)
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
        if conn.keep_alive and not conn.closed and not self._closed and len(self._idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        return status, data

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
