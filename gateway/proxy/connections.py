"""Limits on connections that only the HTTP server can set (docs/security.md, Limits): how long a client
may take to send a request's headers and then its body, and how many connections stay open. uvicorn has
none of these (its keep-alive timeout only starts once a response is sent), so ``tracegym serve`` runs its
httptools protocol with them added (``limited_protocol``): one timer per connection, re-armed at each
stage, so a client that trickles its headers or body is answered 408 and closed, and a connection past
``max_connections`` is answered 503 and closed before it is read. The same protocol sends a response's
head and its body's first chunk in one socket write (``OneWrite``): one system call and one wake-up of the
client fewer per call."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": code}})
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


_TIMED_OUT = _raw_response(408, "Request Timeout", "the request was not received in time", "request_timeout")
_FULL = _raw_response(503, "Service Unavailable", "too many open connections: retry shortly", "too_many_connections")


class OneWrite:
    """The transport as one response cycle of uvicorn's sees it: the response head (the cycle's first write)
    is held until the body's first write and both go out as one. Not for a ``HEAD`` request (no body is
    written); an interim ``100 Continue`` goes out at once. A chunked head (a stream, whose first chunk may
    come later) is held only until the event loop (``loop``; without one, not at all) has run the callbacks
    of this turn: a stream whose first chunk is ready (the gateway's SSE streams pull their first upstream
    event before they start) sends both in one write, and one whose first chunk is not still gets its
    head at once."""

    __slots__ = ("head", "loop", "transport")

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.transport = transport
        self.loop = loop
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self.head
        if head is not None:
            self.head = None
            self.transport.write(head + data)
        elif not data.startswith(b"HTTP/1.1 ") or data.startswith(b"HTTP/1.1 100 "):
            self.transport.write(data)
        elif b"\r\ntransfer-encoding: chunked\r\n" not in data:
            self.head = data
        elif self.loop is not None:
            self.head = data
            self.loop.call_soon(self._head_out, data)
        else:
            self.transport.write(data)

    def _head_out(self, head: bytes) -> None:
        if self.head is head:  # no body was written in the turn that wrote the head
            self.head = None
            self.transport.write(head)

    def close(self) -> None:
        if self.head is not None:  # a response given up after its head: what was written goes out
            self.transport.write(self.head)
            self.head = None
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


def limited_protocol(header_timeout_s: float, body_timeout_s: float, max_connections: int) -> type:
    """uvicorn's httptools protocol (pass it as ``uvicorn.run(..., http=...)``) with a header deadline (from
    the connection's start, or from a kept-alive connection's next request's first byte), a body deadline
    (from the end of the headers) and a connection limit; each response's head and body in one write."""

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(_FULL)
                transport.close()
                return
            self._arm(header_timeout_s)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # a fresh connection's deadline runs from the connection's start
                self._arm(header_timeout_s)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()  # makes the request's cycle and schedules its task
            if self.cycle is not None and self.scope["method"] != "HEAD":
                self.cycle.transport = OneWrite(self.transport, self.loop)
            self._arm(body_timeout_s)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
                self.transport.write(_TIMED_OUT)
            self.transport.close()

    return LimitedHttpToolsProtocol
