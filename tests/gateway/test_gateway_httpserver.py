"""The gateway's own HTTP/1.1 server (gateway/httpserver.py) with raw sockets: framing of
requests (Content-Length, chunked, 100-continue, limits), keep-alive, pipelining, HTTP/1.0,
HEAD, malformed input, disconnects, idle connections and graceful shutdown. Runs on asyncio's
loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import orjson
import pytest
from raw_server import LOOPS

from gateway.errors import error_response
from gateway.httpserver import (
    HttpError,
    HttpServer,
    Request,
    Response,
    Routes,
    StreamResponse,
    body_framing,
    head_end,
    json_response,
    parse_request_head,
)


class App:
    """Routes for the tests, and what the handlers saw."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.routes = Routes()
        self.routes.add("POST", "/echo", self.echo)
        self.routes.add("GET", "/hello", self.hello)
        self.routes.add("GET", "/stream", self.stream)
        self.routes.add("GET", "/slow", self.slow)
        self.routes.add("GET", "/boom", self.boom)
        self.routes.add("POST", "/items/{item}/{action:on|off}", self.item)

    async def echo(self, req: Request) -> Response:
        self.bodies.append(req.body)
        return Response(200, req.body, [("x-got", req.headers.get("x-tag", ""))])

    async def hello(self, req: Request) -> Response:
        return json_response(b'{"hello": "world"}')

    async def item(self, req: Request) -> Response:
        return json_response(orjson.dumps(req.match_info))

    async def stream(self, req: Request) -> StreamResponse:
        resp = StreamResponse(200, [("Content-Type", "text/event-stream")])
        await resp.prepare(req)
        await resp.write(b"data: 1\n\n")
        await self.release.wait()
        await resp.write_eof(b"data: 2\n\n")
        return resp

    async def slow(self, req: Request) -> Response:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return Response(200, b"late")

    async def boom(self, req: Request) -> Response:
        raise RuntimeError("handler bug")


@asynccontextmanager
async def server(**kwargs: object) -> AsyncIterator[tuple[App, HttpServer, int]]:
    app = App()
    srv = HttpServer(
        app.routes,
        error=lambda status, msg: error_response(status, msg),
        max_body_bytes=kwargs.pop("max_body_bytes", 1000),  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )
    port = await srv.start("127.0.0.1", 0)
    try:
        yield app, srv, port
    finally:
        await srv.shutdown(1.0)


async def exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection; everything received until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(-1), 5)
    finally:
        writer.close()


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Split a byte stream of Content-Length or chunked answers."""
    out = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.decode().lower()] = v.strip().decode()
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, raw = raw[:n], raw[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size_line, _, raw = raw.partition(b"\r\n")
                size = int(size_line, 16)
                body += raw[:size]
                raw = raw[size + 2 :]
                if size == 0:
                    break
        else:
            body, raw = raw, b""
        out.append((status, headers, body))
    return out


def req(method: str, path: str, body: bytes = b"", extra: bytes = b"") -> bytes:
    cl = b"Content-Length: %d\r\n" % len(body) if body or method == "POST" else b""
    return b"%s %s HTTP/1.1\r\nHost: x\r\n%s%s\r\n%s" % (
        method.encode(),
        path.encode(),
        cl,
        extra,
        body,
    )


def test_parse_request_head_and_framing() -> None:
    r = parse_request_head(
        b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nX-Tag:  v \r\nx-tag: second"
    )
    assert (r.method, r.path, r.query, r.http11, r.keep_alive) == (
        "POST",
        "/v1/completions",
        "x=1",
        True,
        True,
    )
    assert r.headers == {"host": "a", "x-tag": "v"}  # first value wins, trimmed
    assert r.fields == [(b"host", b"a"), (b"x-tag", b"v"), (b"x-tag", b"second")]
    assert not parse_request_head(b"GET / HTTP/1.0").keep_alive
    assert parse_request_head(b"GET / HTTP/1.0\r\nConnection: keep-alive").keep_alive
    assert not parse_request_head(b"GET / HTTP/1.1\r\nConnection: close").keep_alive
    assert parse_request_head(b"GET http://h:1/p?q HTTP/1.1").path == "/p"
    # bare LF line ends (RFC 9112 section 2.2), alone or mixed with CRLF
    lf = parse_request_head(b"GET /p HTTP/1.1\nHost: a\r\nX-Tag: v")
    assert (lf.path, lf.fields) == ("/p", [(b"host", b"a"), (b"x-tag", b"v")])
    assert head_end(b"GET / HTTP/1.1\r\nHost: a\r\n\r\nbody") == (23, 27)
    assert head_end(b"GET / HTTP/1.1\nHost: a\n\nbody") == (22, 24)
    assert head_end(b"GET / HTTP/1.1\nHost: a\r\n\nbody") == (22, 25)
    assert head_end(b"GET / HTTP/1.1\nA: \r\n\r\n\n\n") == (18, 22)  # the first blank line
    assert head_end(b"GET / HTTP/1.1\r\nHost: a\r\n") == (-1, -1)
    assert body_framing(parse_request_head(b"POST / HTTP/1.1\r\nContent-Length: 5")) == (5, False)
    assert body_framing(parse_request_head(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked")) == (
        None,
        True,
    )
    for bad, status in (
        (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked", 400),
        (b"GET / HTTP/1.1\r\nTransfer-Encoding: gzip", 501),
        (b"GET / HTTP/1.1\r\nContent-Length: +1", 400),
    ):
        with pytest.raises(HttpError) as err:
            body_framing(parse_request_head(bad))
        assert err.value.status == status
    for bad, status in (
        (b"GET /", 400),
        (b"GET / HTTP/2.0", 505),
        (b"PRI * HTTP/2.0", 505),
        (b"GET  / HTTP/1.1", 400),
        (b"GET nopath HTTP/1.1", 400),
        (b"GET http://[/health HTTP/1.1", 400),  # urlsplit raises ValueError on it
        (b"GET https://a]b/x HTTP/1.1", 400),
        (b"GET / HTTP/1.1\r\nBad Name: x", 400),
        (b"GET / HTTP/1.1\r\n folded", 400),
        (b"GET / HTTP/1.1\r\nX: a\x01b", 400),
    ):
        with pytest.raises(HttpError) as err:
            parse_request_head(bad)
        assert err.value.status == status, bad


async def _keep_alive_pipelining_and_framings() -> None:
    async with server() as (_app, _srv, port):
        chunked = (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nX-Tag: c\r\n\r\n"
            b"3\r\nabc\r\n4;ext\r\ndefg\r\n0\r\nTrailer: t\r\n\r\n"
        )
        data = (
            req("POST", "/echo", b"first", b"X-Tag: 1\r\n")
            + chunked
            + req("GET", "/hello")
            + req("POST", "/echo", b"last", b"Connection: close\r\n")
        )
        out = responses(await exchange(port, data))
        assert [(s, b) for s, _, b in out] == [
            (200, b"first"),
            (200, b"abcdefg"),
            (200, b'{"hello": "world"}'),
            (200, b"last"),
        ]
        assert out[0][1]["x-got"] == "1" and out[1][1]["x-got"] == "c"
        assert "date" in out[0][1] and out[3][1]["connection"] == "close"
        # The same bytes one at a time: the parser resumes anywhere.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            if i % 7 == 0:
                await writer.drain()
        got = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert [b for _, _, b in responses(got)][1] == b"abcdefg"


async def _http10_head_and_continue() -> None:
    async with server() as (_app, _srv, port):
        out = responses(await exchange(port, b"GET /hello HTTP/1.0\r\n\r\n"))
        assert out[0][0] == 200 and out[0][1]["connection"] == "close"
        raw = await exchange(port, b"HEAD /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert raw.endswith(b"\r\n\r\n") and b"Content-Length: 18" in raw  # no body
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"body")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK") and await reader.readexactly(4) == b"body"
        writer.close()


async def _errors_are_json_and_close() -> None:
    async with server(max_body_bytes=100) as (_app, _srv, port):
        cases = [
            (b"GARBAGE\r\n\r\n", 400),
            (b"GET /hello HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n", 400),
            (b"GET /hello HTTP/1.1\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431),
            (b"GET /hello HTTP/1.1\r\nX-Big: " + b"a" * 70000, 431),  # never ends
            (req("POST", "/echo", b"x" * 101), 413),
            (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n", 413),
            (
                b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"40\r\n"
                + b"y" * 64
                + b"\r\n"
                + b"40\r\n"
                + b"y" * 64
                + b"\r\n0\r\n\r\n",
                413,
            ),
            (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
            (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
            (b"GET http://[/hello HTTP/1.1\r\nHost: x\r\n\r\n", 400),
            (req("GET", "/nowhere", extra=b"Connection: close\r\n"), 404),
            (req("DELETE", "/hello", extra=b"Connection: close\r\n"), 405),
            (req("GET", "/boom", extra=b"Connection: close\r\n"), 500),
        ]
        for data, status in cases:
            out = responses(await exchange(port, data))
            assert out and out[0][0] == status, (data[:60], out)
            err = orjson.loads(out[0][2])["error"]
            assert err["message"], data[:60]
            if status == 405:
                assert out[0][1]["allow"] == "GET"
        # After all that, the server still serves.
        assert responses(await exchange(port, req("GET", "/hello", extra=b"Connection: close\r\n")))


async def _bare_lf_line_ends() -> None:
    """A head whose lines end in a bare LF is read at once (not left waiting for a CRLF blank
    line until the head deadline), a body and a pipelined request after it included."""
    async with server() as (_app, _srv, port):
        data = (
            b"POST /echo HTTP/1.1\nHost: x\nX-Tag: lf\nContent-Length: 3\n\nabc"
            + b"GET /hello HTTP/1.1\nHost: x\nConnection: close\n\n"
        )
        for sent in (data, data.replace(b"Tag: lf\n", b"Tag: lf\r\n")):
            out = responses(await exchange(port, sent))
            assert [(s, b) for s, _, b in out] == [(200, b"abc"), (200, b'{"hello": "world"}')]
            assert out[0][1]["x-got"] == "lf"
        # one byte at a time: the blank line is found across reads
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
        got = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert [s for s, _, _ in responses(got)] == [200, 200]


async def _refusal_behind_a_request_in_flight() -> None:
    """A bad request pipelined behind good ones gets its error after their answers (which
    keep the connection open for it), then the connection closes."""
    async with server(max_body_bytes=100) as (app, _srv, port):
        for bad, status in (
            (b"GARBAGE\r\n\r\n", 400),
            (b"GET http://[/hello HTTP/1.1\r\nHost: x\r\n\r\n", 400),
            (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n", 413),
        ):
            out = responses(await exchange(port, req("POST", "/echo", b"first") + bad))
            assert [s for s, _, _ in out] == [200, status], (bad, out)
            assert out[0][2] == b"first" and "connection" not in out[0][1]
            assert out[1][1]["connection"] == "close"
        # Behind a stream still open when the bad request arrives.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(req("GET", "/stream") + b"GARBAGE\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"data: 1\n\n\r\n"), 5)
        app.release.set()
        rest = await asyncio.wait_for(reader.read(-1), 5)
        writer.close()
        assert rest.startswith(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        assert [s for s, _, _ in responses(rest[len(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n") :])] == [400]


async def _pattern_routes_decode_parameters() -> None:
    async with server() as (_app, _srv, port):
        raw = await exchange(port, req("POST", "/items/a%20b/on", extra=b"Connection: close\r\n"))
        assert orjson.loads(responses(raw)[0][2]) == {"item": "a b", "action": "on"}
        raw = await exchange(port, req("POST", "/items/a/maybe", extra=b"Connection: close\r\n"))
        assert responses(raw)[0][0] == 404


async def _streams_disconnects_and_idle_connections() -> None:
    async with server(keepalive_s=0.3) as (app, srv, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(req("GET", "/stream"))
        head = await asyncio.wait_for(reader.readuntil(b"data: 1\n\n\r\n"), 5)
        assert b"Transfer-Encoding: chunked" in head  # the head went with the first piece
        app.release.set()
        tail = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
        assert tail == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"  # last piece and end in one write
        # The client disconnects during a request: its handler is cancelled.
        writer.write(req("GET", "/slow"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)
        # An idle keep-alive connection is closed after keepalive_s.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert 0.3 <= time.monotonic() - t0 < 2.0
        writer.close()
        await asyncio.sleep(0.05)
        assert not srv.connections


async def _graceful_shutdown() -> None:
    app = App()
    srv = HttpServer(app.routes, error=error_response, max_body_bytes=100)
    port = await srv.start("127.0.0.1", 0)
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(req("GET", "/stream"))
    await asyncio.wait_for(reader.readuntil(b"data: 1\n\n\r\n"), 5)
    stop = asyncio.ensure_future(srv.shutdown(5.0))
    assert await asyncio.wait_for(idle_r.read(), 5) == b""  # idle connections close at once
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)  # no longer listening
    await asyncio.sleep(0.1)
    assert not stop.done()  # waits for the open stream
    app.release.set()
    rest = await asyncio.wait_for(reader.read(), 5)
    assert rest.endswith(b"0\r\n\r\n")
    await asyncio.wait_for(stop, 5)
    writer.close()
    idle_w.close()
    # Past the drain timeout, what is left is cancelled.
    app2 = App()
    srv2 = HttpServer(app2.routes, error=error_response, max_body_bytes=100)
    port = await srv2.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(req("GET", "/slow"))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await srv2.shutdown(0.2)
    assert time.monotonic() - t0 < 2 and app2.cancelled.is_set()
    writer.close()


@asynccontextmanager
async def client_not_reading(
    app: App,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A server of ``app``'s routes and a connection to it whose client does not read yet
    (``writer.transport.resume_reading()`` starts it)."""
    srv = HttpServer(app.routes, error=error_response, max_body_bytes=100)
    port = await srv.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
    writer.transport.pause_reading()
    try:
        yield reader, writer
    finally:
        writer.close()
        await srv.shutdown(1.0)


async def _slow_client_gets_flow_control() -> None:
    big = b"x" * (1 << 20)
    written = []

    class Big(App):
        async def hello(self, req: Request) -> StreamResponse:
            resp = StreamResponse(200, [])
            await resp.prepare(req)
            for _ in range(32):
                await resp.write(big)
                written.append(1)
            await resp.write_eof()
            return resp

    app = Big()
    app.routes.add("GET", "/big", app.hello)
    async with client_not_reading(app) as (reader, writer):
        writer.write(req("GET", "/big"))
        await asyncio.sleep(0.3)
        assert len(written) < 32  # the handler waits for the client instead of buffering 32 MiB
        writer.transport.resume_reading()
        total = 0
        while True:
            chunk = await asyncio.wait_for(reader.read(1 << 20), 5)
            total += len(chunk)
            if chunk.endswith(b"0\r\n\r\n"):
                break
        assert len(written) == 32 and total > 32 * len(big)


async def _pipelining_client_that_never_reads() -> None:
    """Requests pipelined by a client that does not read the answers: whole answers were
    written without waiting for the client, so they piled up in the server's memory (10,000
    requests of /metrics: 54 -> 155 MB). The next request now waits until the client reads."""
    body = b"y" * (256 << 10)
    handled = []

    class Whole(App):
        async def hello(self, req: Request) -> Response:
            handled.append(1)
            return Response(200, body)

    app = Whole()
    app.routes.add("GET", "/whole", app.hello)
    async with client_not_reading(app) as (reader, writer):
        n = 200
        writer.write(req("GET", "/whole") * n)
        await asyncio.sleep(0.5)
        assert len(handled) < n // 2  # (socket buffers hold some; the server holds no more)
        writer.transport.resume_reading()
        total = 0
        while total < n * len(body):
            chunk = await asyncio.wait_for(reader.read(1 << 20), 5)
            assert chunk
            total += len(chunk)
        assert len(handled) == n


async def _head_sent_a_byte_at_a_time() -> None:
    """A big head in many small packets parses in linear time (and correctly)."""
    async with server() as (_app, _srv, port):
        head = req("POST", "/echo", b"body", b"X-Tag: t\r\n" + b"X-Pad: " + b"p" * 30000 + b"\r\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        for i in range(0, len(head), 3):
            writer.write(head[i : i + 3])
            if i % 300 == 0:
                await writer.drain()
                await asyncio.sleep(0)
        status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert status.startswith(b"HTTP/1.1 200") and await reader.readexactly(4) == b"body"
        assert time.monotonic() - t0 < 5
        writer.close()


async def _trickle(writer: asyncio.StreamWriter, every_s: float) -> None:
    """One byte every ``every_s`` until the connection goes: each byte resets the idle clock."""
    with contextlib.suppress(ConnectionError, OSError):
        while not writer.is_closing():
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(every_s)


async def _answer_to_a_trickle(port: int, start: bytes) -> tuple[bytes, float]:
    """Send ``start``, then trickle; (everything received until the server closed, seconds)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(start)
    trickle = asyncio.create_task(_trickle(writer, 0.05))
    try:
        raw = await asyncio.wait_for(reader.read(-1), 10)
    finally:
        trickle.cancel()
        writer.close()
    return raw, time.monotonic() - t0


async def _head_deadline() -> None:
    """A head that trickles in (a byte every 50 ms: never idle) gets 408 once the whole head
    has taken head_timeout_s; a slow head within the deadline is served."""
    async with server(head_timeout_s=0.4, keepalive_s=30) as (_app, srv, port):
        raw, took = await _answer_to_a_trickle(port, b"GET /hello HTTP/1.1\r\nX-Slow: ")
        status, _, body = responses(raw)[0]
        assert status == 408 and "head" in orjson.loads(body)["error"]["message"]
        assert 0.4 - 0.005 <= took < 3.0  # (uvloop rounds its timers to the ms)
        assert (srv.stats.head_timeouts, srv.stats.body_timeouts) == (1, 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        whole = req("GET", "/hello", extra=b"Connection: close\r\n")
        writer.write(whole[:10])
        await asyncio.sleep(0.2)
        writer.write(whole[10:])
        assert responses(await asyncio.wait_for(reader.read(-1), 5))[0][0] == 200
        writer.close()
        assert srv.stats.head_timeouts == 1


async def _body_deadline() -> None:
    """A body (Content-Length or chunked) that trickles in gets 408 once it has taken
    body_timeout_s since its head; the handler never runs; a slow body within it is served."""
    async with server(body_timeout_s=0.4, keepalive_s=30) as (app, srv, port):
        for start in (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\nfirst",
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n",
        ):
            raw, took = await _answer_to_a_trickle(port, start)
            status, _, body = responses(raw)[0]
            assert status == 408 and "body" in orjson.loads(body)["error"]["message"]
            # not before the deadline (uvloop's timers round to the millisecond: 0.3999 seen)
            assert 0.4 - 0.005 <= took < 3.0
        assert (srv.stats.head_timeouts, srv.stats.body_timeouts) == (0, 2)
        assert app.bodies == []
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(req("POST", "/echo", b"0123456789", b"Connection: close\r\n")[:-5])
        await asyncio.sleep(0.2)
        writer.write(b"56789")
        assert responses(await asyncio.wait_for(reader.read(-1), 5))[0][2] == b"0123456789"
        writer.close()


async def _connection_cap() -> None:
    """Over max_connections, a new connection is answered 503 with Retry-After and closed at
    once (and counted); once one closes, a new one is served."""
    async with server(max_connections=2) as (_app, srv, port):
        held = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req("GET", "/hello"))
            await asyncio.wait_for(reader.readuntil(b'world"}'), 5)
            held.append((reader, writer))
        assert srv.stats.open == 2
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(req("GET", "/hello"))
        status, headers, body = responses(await asyncio.wait_for(reader.read(-1), 5))[0]
        writer.close()
        assert status == 503 and headers["retry-after"] == "1"
        assert "connections" in orjson.loads(body)["error"]["message"]
        assert (srv.stats.refused, srv.stats.open) == (1, 2)
        held[0][1].close()
        deadline = time.monotonic() + 5
        while srv.stats.open > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        raw = await exchange(port, req("GET", "/hello", extra=b"Connection: close\r\n"))
        assert responses(raw)[0][0] == 200 and srv.stats.refused == 1
        held[1][1].close()


SCENARIOS: dict[str, Callable[[], Awaitable[None]]] = {
    f.__name__.lstrip("_"): f
    for f in (
        _keep_alive_pipelining_and_framings,
        _http10_head_and_continue,
        _errors_are_json_and_close,
        _refusal_behind_a_request_in_flight,
        _bare_lf_line_ends,
        _pattern_routes_decode_parameters,
        _streams_disconnects_and_idle_connections,
        _graceful_shutdown,
        _slow_client_gets_flow_control,
        _pipelining_client_that_never_reads,
        _head_sent_a_byte_at_a_time,
        _head_deadline,
        _body_deadline,
        _connection_cap,
    )
}


@pytest.mark.parametrize("loop_factory", LOOPS)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_http_server(name: str, loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as r:
        r.run(asyncio.wait_for(SCENARIOS[name](), 30))
