"""``connections.OneWrite``: a response's head goes out with its body in one write, a stream's head with its
first chunk when that is written in the same turn of the event loop, and a stream's head whose first chunk
comes later, a ``HEAD`` answer, a bodiless 204 and an interim ``100 Continue`` are not held back (a real
uvicorn server with ``limited_protocol``)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import uvicorn

from tests.procs import free_port
from tracegym.gateway.proxy.connections import OneWrite, limited_protocol


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_head_and_body_are_one_write_and_streams_are_not_held() -> None:
    t = _Transport()
    w = OneWrite(t)
    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert t.writes == []
    w.write(b"hi")
    assert t.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi"]
    t2 = _Transport()
    s = OneWrite(t2)
    s.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    s.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert len(t2.writes) == 2  # neither waited
    t3 = _Transport()
    given_up = OneWrite(t3)
    given_up.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 5\r\n\r\n")
    given_up.close()
    assert t3.writes and t3.closed


def test_a_streams_head_waits_for_its_first_chunk_only_in_the_same_turn_of_the_loop() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    async def turns() -> tuple[list[bytes], list[bytes]]:
        loop = asyncio.get_running_loop()
        ready, late = _Transport(), _Transport()
        w = OneWrite(ready, loop)
        w.write(head)
        w.write(b"5\r\nfirst\r\n")  # the first chunk in the same turn: one write
        s = OneWrite(late, loop)
        s.write(head)
        await asyncio.sleep(0)  # the turn ends without a chunk: the head goes out alone
        held = list(late.writes)
        s.write(b"4\r\nlate\r\n")
        return ready.writes, [*held, b"|", *late.writes[len(held):]]

    ready, late = asyncio.run(turns())
    assert ready == [head + b"5\r\nfirst\r\n"]
    assert late == [head, b"|", b"4\r\nlate\r\n"]


async def _app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await asyncio.sleep(1.0)  # the head must not wait for this first chunk
        await send({"type": "http.response.body", "body": b"late", "more_body": False})
    elif path == "/empty":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def test_responses_through_the_protocol() -> None:
    port = free_port()
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            http=limited_protocol(10, 10, 100))
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    try:
        while not server.started:
            time.sleep(0.02)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=10) as http:
            for _ in range(3):  # kept-alive connection: each response whole
                r = http.post(base + "/", content=b"x")
                assert (r.status_code, r.content) == (200, b"ok")
            assert http.head(base + "/").status_code == 200
            assert http.get(base + "/empty").status_code == 204
            assert http.get(base + "/").content == b"ok"
            r = http.post(base + "/", content=b"body", headers={"Expect": "100-continue"})
            assert r.content == b"ok"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            t = time.monotonic()
            head = sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 200") and time.monotonic() - t < 0.8  # before the first chunk
    finally:
        server.should_exit = True
