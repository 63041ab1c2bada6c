"""The keep-alive client of the hot upstream call against real aiohttp servers: connections are reused,
a connection the server closed while idle is replaced without failing the call, and failures map to
the gateway's errors (unreachable → 502, silence → 504, a dropped response → 502)."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.procs import free_port
from tracegym.gateway.openai_errors import UpstreamTimeout, UpstreamUnavailable
from tracegym.gateway.proxy.upstream.keepalive import KeepAlivePool, StreamedBody


class Echo:
    def __init__(self) -> None:
        self.peers: list[object] = []

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))
        body = orjson.loads(await request.read())
        if body.get("sleep"):
            await asyncio.sleep(body["sleep"])
        if body.get("drop"):
            request.transport.close()
            await asyncio.sleep(1)
        if body.get("close_later"):  # answer keep-alive, then drop the idle connection (keep-alive expiry)
            asyncio.get_running_loop().call_later(0.1, request.transport.close)
        if body.get("status"):
            return web.json_response({"error": {"message": "nope"}}, status=body["status"])
        chunked = body.get("chunked")
        resp = web.StreamResponse() if chunked else None
        if resp is not None:
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(orjson.dumps({"echo": body})[:5])
            await resp.write(orjson.dumps({"echo": body})[5:])
            await resp.write_eof()
            return resp
        return web.Response(body=orjson.dumps({"echo": body}), content_type="application/json")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """``parts`` chunk by chunk (``pause`` seconds apart, each ``times`` over), then ends, drops or stalls."""
        self.peers.append(request.transport.get_extra_info("peername"))
        body = orjson.loads(await request.read())
        resp = web.StreamResponse(status=body.get("status", 200))
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in body["parts"]:
            await resp.write(part.encode() * body.get("times", 1))
            await asyncio.sleep(body.get("pause", 0))
        if body.get("then") == "drop":
            request.transport.close()
        elif body.get("then") == "stall":
            await asyncio.sleep(5)
        await resp.write_eof()
        return resp


async def _server() -> tuple[TestServer, Echo]:
    echo = Echo()
    app = web.Application()
    app.router.add_post("/generate", echo.echo)
    app.router.add_post("/stream", echo.stream)
    srv = TestServer(app, host="127.0.0.1", port=free_port())
    await srv.start_server()
    return srv, echo


async def test_reuses_connections_and_parses_bodies() -> None:
    srv, echo = await _server()
    pool = KeepAlivePool(f"http://127.0.0.1:{srv.port}", connect_timeout=2, read_timeout=5)
    try:
        for i in range(5):
            status, raw = await pool.post_json("/generate", orjson.dumps({"i": i, "u": "é🙂"}))
            assert status == 200 and orjson.loads(raw) == {"echo": {"i": i, "u": "é🙂"}}
        status, raw = await pool.post_json("/generate", orjson.dumps({"chunked": True}))
        assert orjson.loads(raw) == {"echo": {"chunked": True}}
        assert len(set(echo.peers)) == 1  # one keep-alive connection for all sequential calls
        many = await asyncio.gather(*(pool.post_json("/generate", orjson.dumps({"j": j})) for j in range(20)))
        assert [orjson.loads(r)["echo"]["j"] for _, r in many] == list(range(20))
        status, raw = await pool.post_json("/generate", orjson.dumps({"status": 400}))
        assert status == 400 and orjson.loads(raw)["error"]["message"] == "nope"
    finally:
        pool.close()
        await srv.close()


async def test_server_closed_idle_connection_is_replaced() -> None:
    srv, echo = await _server()
    pool = KeepAlivePool(f"http://127.0.0.1:{srv.port}", connect_timeout=2, read_timeout=5, idle_timeout=60)
    try:
        await pool.post_json("/generate", orjson.dumps({"close_later": True}))
        await asyncio.sleep(0.4)  # the server drops the idle connection
        status, _ = await pool.post_json("/generate", b"{}")
        assert status == 200 and len(set(echo.peers)) == 2
    finally:
        pool.close()
        await srv.close()


async def test_failures_map_to_gateway_errors() -> None:
    pool = KeepAlivePool(f"http://127.0.0.1:{free_port()}", connect_timeout=2, read_timeout=5)
    with pytest.raises(UpstreamUnavailable, match="unreachable"):
        await pool.post_json("/generate", b"{}")
    srv, _ = await _server()
    pool = KeepAlivePool(f"http://127.0.0.1:{srv.port}", connect_timeout=2, read_timeout=0.3)
    try:
        with pytest.raises(UpstreamTimeout, match=r"did not answer within 0\.3s"):
            await pool.post_json("/generate", orjson.dumps({"sleep": 2}))
        with pytest.raises(UpstreamUnavailable, match="failed"):
            await pool.post_json("/generate", orjson.dumps({"drop": True}))
        status, _ = await pool.post_json("/generate", b"{}")  # the pool is still usable
        assert status == 200
    finally:
        pool.close()
        await srv.close()
    with pytest.raises(ValueError, match="http://"):
        KeepAlivePool("https://example.com", connect_timeout=1, read_timeout=1)


async def test_reused_connection_closed_on_arrival_is_retried_once() -> None:
    """The keep-alive race: the server closes a reused connection as the request arrives, unanswered."""
    conns = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the next request on this connection: dropped unanswered
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = KeepAlivePool(f"http://127.0.0.1:{port}", connect_timeout=2, read_timeout=5)
    try:
        assert await pool.post_json("/generate", b"{}") == (200, b"{}")
        assert await pool.post_json("/generate", b"{}") == (200, b"{}")
        assert conns == 2
    finally:
        pool.close()
        server.close()
        await server.wait_closed()


# ---------------------------------------------------------------------------------------- streamed bodies

async def _read_all(answer: StreamedBody) -> bytes:
    parts = []
    while chunk := await answer.read():
        parts.append(chunk)
    return b"".join(parts)


async def test_a_streamed_body_arrives_as_sent_and_its_connection_is_reused_once_read() -> None:
    srv, echo = await _server()
    pool = KeepAlivePool(f"http://127.0.0.1:{srv.port}", connect_timeout=2, read_timeout=5)
    try:
        answer = await pool.post_stream("/stream", orjson.dumps({"parts": ["data: 1\n\n", "data: 2\n\n"], "pause": 0.05}))
        assert answer.status == 200
        first = await answer.read()
        assert first == b"data: 1\n\n"  # the first chunk, before the second is sent
        assert await _read_all(answer) == b"data: 2\n\n"
        answer.finish()
        again = await pool.post_stream("/stream", orjson.dumps({"parts": ["x"], "status": 400}))
        assert again.status == 400 and await _read_all(again) == b"x"
        again.finish()
        assert len(set(echo.peers)) == 1  # both on the one keep-alive connection
        unread = await pool.post_stream("/stream", orjson.dumps({"parts": ["a", "b"], "pause": 0.2}))
        assert await unread.read() == b"a"
        unread.finish()  # the consumer went away mid-body: the connection is not reused
        assert (await pool.post_json("/stream", orjson.dumps({"parts": ["c"]})))[1] == b"c"
        assert len(set(echo.peers)) == 2
        big = await pool.post_stream("/stream", orjson.dumps({"parts": ["y", "z"], "times": 1 << 19}))
        await asyncio.sleep(0.3)  # more than the buffer arrives unread: the connection stops reading
        assert big._conn.paused
        assert await _read_all(big) == b"y" * (1 << 19) + b"z" * (1 << 19)
        big.finish()
    finally:
        pool.close()
        await srv.close()


async def test_a_stream_that_stalls_or_drops_fails_with_the_gateway_errors() -> None:
    srv, _ = await _server()
    pool = KeepAlivePool(f"http://127.0.0.1:{srv.port}", connect_timeout=2, read_timeout=0.5)
    try:
        slow = await pool.post_stream("/stream", orjson.dumps({"parts": ["a", "b", "c"], "pause": 0.3}))
        assert await _read_all(slow) == b"abc"  # each wait is under the read timeout, the whole is not
        slow.finish()
        stalled = await pool.post_stream("/stream", orjson.dumps({"parts": ["a"], "then": "stall"}))
        assert await stalled.read() == b"a"
        with pytest.raises(UpstreamTimeout, match=r"did not send more within 0\.5s"):
            await stalled.read()
        stalled.finish()
        dropped = await pool.post_stream("/stream", orjson.dumps({"parts": ["a"], "then": "drop"}))
        assert await dropped.read() == b"a"
        await asyncio.sleep(0.3)  # the connection is lost while nothing reads: the next read says so at once
        with pytest.raises(UpstreamUnavailable, match="lost mid-response"):
            await dropped.read()
        dropped.finish()
        assert (await pool.post_json("/stream", orjson.dumps({"parts": ["ok"]})))[1] == b"ok"
    finally:
        pool.close()
        await srv.close()
