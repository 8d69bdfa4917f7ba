"""The gateway's own HTTP/1.1 client (gateway/upstream.py) against real loopback servers that
frame their answers every legal way and misbehave in the ways engines do: reuse of keep-alive
connections, servers closing idle connections, resets mid-body, garbage, oversized heads,
truncated bodies, silence. Every scenario runs on asyncio's loop and on uvloop (the loop
``kvgate gateway`` uses), and ends by checking that no connection leaked."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Awaitable, Callable

import pytest
from raw_server import LOOPS, ok_response, raw_server, reset

from gateway.upstream import (
    HIGH_WATER,
    ChunkedDecoder,
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamTimeout,
    make_target,
    parse_head,
)


def run(loop_factory: Callable[[], asyncio.AbstractEventLoop], coro: Awaitable[None]) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as r:
        r.run(asyncio.wait_for(coro, 20))


async def settle(pool: UpstreamPool, busy: int = 0) -> None:
    """Let close callbacks run, then check that only idle pooled connections are open."""
    for _ in range(50):
        await asyncio.sleep(0.01)
        if len(pool.connections()) == pool.idle_count() + busy:
            break
    assert len(pool.connections()) == pool.idle_count() + busy


async def post(pool: UpstreamPool, url: str, body: bytes = b"{}", path: str = "/v1/completions"):
    return await pool.request(make_target(url, path), b"POST", b"x-test: 1\r\n", body)


# ---- pure parts -------------------------------------------------------------------------------


def test_parse_head_framing_and_strictness() -> None:
    h = parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 12")
    assert (h.status, h.length, h.chunked, h.keep_alive) == (200, 12, False, True)
    assert h.content_type == b"text/event-stream"
    assert h.fields == [(b"content-type", b"text/event-stream"), (b"content-length", b"12")]
    h = parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5")
    assert h.chunked and h.length is None and not h.keep_alive  # both: not reused
    assert not parse_head(b"HTTP/1.1 200 OK").keep_alive  # no framing: until close
    assert parse_head(b"HTTP/1.1 204 No Content").keep_alive
    assert not parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1").keep_alive
    assert parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\nConnection: keep-alive").keep_alive
    assert not parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close").keep_alive
    assert parse_head(b"HTTP/1.1 404").status == 404  # no reason phrase
    for bad in (
        b"HTTP/2 200 OK",
        b"ICY 200 OK",
        b"HTTP/1.1 20 OK",
        b"HTTP/1.1 200 OK\r\nBad Header: x",
        b"HTTP/1.1 200 OK\r\n folded: x",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked",
        b"HTTP/1.1 200 OK\r\nX: a\x00b",
    ):
        with pytest.raises(ValueError):
            parse_head(bad)


def test_chunked_decoder_at_every_split_point() -> None:
    body = (
        b"4;ext=1\r\nWiki\r\n5\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nTrailer: x\r\n\r\nNEXT"
    )
    for cut in range(1, len(body)):
        dec = ChunkedDecoder()
        out = dec.feed(body[:cut])
        unread = body[cut:]
        if not dec.done:
            out += dec.feed(unread)
            unread = b""
        assert b"".join(out) == b"Wikipedia in\r\n\r\nchunks."
        assert dec.done and dec.tail + unread == b"NEXT"
    rng = random.Random(7)
    for _ in range(200):  # random splits into many pieces
        dec, out, pos = ChunkedDecoder(), [], 0
        while pos < len(body) and not dec.done:
            step = rng.randint(1, 6)
            out += dec.feed(body[pos : pos + step])
            pos += step
        assert b"".join(out) == b"Wikipedia in\r\n\r\nchunks."
    for bad in (b"zz\r\n", b"4\r\nWikiXX", b"-1\r\n", b"1" * 20 + b"\r\n"):
        with pytest.raises(ValueError):
            ChunkedDecoder().feed(bad)
    with pytest.raises(ValueError):
        ChunkedDecoder().feed(b"1" * 5000)  # a size line that never ends
    # a line ended by a bare LF can never become valid: refused at once, not at the timeout
    for bad in (b"5\nhello\r\n", b"0\r\n\n", b"0\r\nTrailer: x\n"):
        with pytest.raises(ValueError, match="bare LF"):
            ChunkedDecoder().feed(bad)


def test_targets() -> None:
    t = make_target("http://127.0.0.1:8001/prefix/", "/v1/completions")
    assert (t.origin.host, t.origin.port, t.path, t.host_header) == (
        "127.0.0.1",
        8001,
        b"/prefix/v1/completions",
        b"127.0.0.1:8001",
    )
    assert make_target("https://engine.example", "/health").origin.port == 443
    with pytest.raises(ValueError):
        make_target("ftp://x", "/")


# ---- against real servers ---------------------------------------------------------------------


async def _content_length_keep_alive_and_request_bytes() -> None:
    async def script(conn, n, head, body, w):
        w.write(ok_response(b'{"n": %d}' % n))

    async with raw_server(script) as (url, seen):
        pool = UpstreamPool()
        for i in range(3):
            r = await post(pool, url, b'{"i": %d}' % i)
            assert r.status == 200 and r.header("content-type") == "application/json"
            assert await r.read() == b'{"n": %d}' % (i + 1)
        assert seen.connections == 1  # one keep-alive connection, reused
        head, body = seen.requests[0][1:]
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"x-test: 1\r\n" in head and b"Content-Length: 8\r\n" in head
        assert body == b'{"i": 0}'
        assert pool.idle_count() == 1
        await settle(pool)
        await pool.close()
        assert pool.connections() == []


async def _chunked_streams_arrive_as_sent() -> None:
    release = asyncio.Event()

    async def script(conn, n, head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        w.write(b"Transfer-Encoding: chunked\r\n\r\n")
        w.write(b"8\r\ndata: 1\n")
        await w.drain()
        await asyncio.sleep(0.02)
        w.write(b"\r\n")  # the CRLF after the data, in a packet of its own
        w.write(b"8\r\ndata: 2\n\r\n")
        await w.drain()
        await release.wait()
        w.write(b"8\r\ndata: 3\n\r\n0\r\nx-trailer: 1\r\n\r\n")

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        r = await post(pool, url)
        assert r.is_event_stream
        got = b""
        while got != b"data: 1\ndata: 2\n":  # arrives before the server finishes
            got += await r.read_chunk()
        assert not r.complete
        release.set()
        assert await r.read_chunk() == b"data: 3\n"
        assert await r.read_chunk() == b"" and r.at_eof
        assert pool.idle_count() == 1  # complete with valid framing: reusable
        await settle(pool)
        await pool.close()


async def _body_until_close_http10_and_interim() -> None:
    async def script(conn, n, head, body, w):
        if conn == 1:
            w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nno framing, ")
            await w.drain()
            w.write(b"ends at close")
            return "close"
        w.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return None

    async with raw_server(script) as (url, seen):
        pool = UpstreamPool()
        r = await post(pool, url)
        assert r.status == 200 and await r.read() == b"no framing, ends at close"
        r = await post(pool, url)
        assert await r.read() == b"ok"
        await settle(pool)
        assert pool.idle_count() == 0  # neither framing lets the connection be reused
        assert seen.connections == 2
        await pool.close()


async def _server_closing_idle_connections() -> None:
    async def script(conn, n, head, body, w):
        w.write(ok_response())
        return "close" if conn == 1 else None  # the first connection closes after answering

    async with raw_server(script) as (url, seen):
        pool = UpstreamPool()
        assert (await (await post(pool, url)).read()) == b'{"ok": true}'
        await settle(pool)
        assert pool.idle_count() == 0  # the close was noticed: nothing stale kept
        assert (await (await post(pool, url)).read()) == b'{"ok": true}'
        assert seen.connections == 2
        await pool.close()


async def _keep_alive_race_is_retried_once_on_a_new_connection() -> None:
    async def script(conn, n, head, body, w):
        if conn == 1 and n == 2:
            return "reset"  # the engine drops the reused connection without answering
        w.write(ok_response(b"conn %d" % conn))
        return None

    async with raw_server(script) as (url, seen):
        pool = UpstreamPool()
        assert await (await post(pool, url)).read() == b"conn 1"
        assert await (await post(pool, url)).read() == b"conn 2"
        assert seen.connections == 2
        await settle(pool)
        await pool.close()


async def _fresh_connection_closed_before_answer_is_an_error() -> None:
    async def script(conn, n, head, body, w):
        return "close"  # never answers, on any connection

    async with raw_server(script) as (url, seen):
        pool = UpstreamPool()
        with pytest.raises(UpstreamClosed) as err:
            await post(pool, url)
        assert err.value.before_response
        assert seen.connections == 1  # a new connection is not retried
        await settle(pool)
        await pool.close()


async def _reset_mid_body() -> None:
    async def script(conn, n, head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 40)
        await w.drain()
        await asyncio.sleep(0.02)
        return "reset"

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        r = await post(pool, url)
        with pytest.raises(UpstreamClosed):
            await r.read()
        r = await post(pool, url)  # streamed: what arrived, then the error
        assert await r.read_chunk() == b"x" * 40
        with pytest.raises(UpstreamClosed):
            while await r.read_chunk():
                pass
        await settle(pool)
        assert pool.idle_count() == 0
        await pool.close()


async def _truncated_bodies() -> None:
    async def script(conn, n, head, body, w):
        if n == 1:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
        else:
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        return "close"

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        for _ in range(2):
            r = await post(pool, url)
            with pytest.raises(UpstreamClosed):
                await r.read()
        await settle(pool)
        await pool.close()


async def _garbage_oversized_and_bad_framing() -> None:
    answers = [
        b"this is not http\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000,  # and no end in sight
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nnot-hex\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    ]

    async def script(conn, n, head, body, w):
        w.write(answers[conn - 1])
        await w.drain()
        await asyncio.sleep(0.5)  # the client must not wait for the close to fail
        return "close"

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        for _ in answers:
            t0 = time.monotonic()
            with pytest.raises(UpstreamProtocolError):
                r = await post(pool, url)
                await r.read()
            assert time.monotonic() - t0 < 0.4
        await settle(pool)
        assert pool.idle_count() == 0
        await pool.close()


async def _extra_bytes_after_a_response_are_not_kept() -> None:
    async def script(conn, n, head, body, w):
        w.write(ok_response() + b"HTTP/1.1 200 OK\r\n")  # a stray second answer
        return None

    async with raw_server(script) as (url, seen):
        pool = UpstreamPool()
        assert await (await post(pool, url)).read() == b'{"ok": true}'
        await settle(pool)
        assert pool.idle_count() == 0  # out of step: closed, not reused
        assert await (await post(pool, url)).read() == b'{"ok": true}'
        assert seen.connections == 2
        await pool.close()


async def _idle_timeout_before_and_during_the_body() -> None:
    async def script(conn, n, head, body, w):
        if conn == 2:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await asyncio.sleep(5)

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool(idle_timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout) as err:
            await post(pool, url)
        assert err.value.before_response
        assert 0.3 <= time.monotonic() - t0 < 1.5
        r = await post(pool, url)
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await r.read()
        assert 0.3 <= time.monotonic() - t0 < 1.5
        await settle(pool)
        await pool.close()


async def _connect_refused_and_connect_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
    pool = UpstreamPool(connect_timeout_s=0.3)
    with pytest.raises(UpstreamConnectError):
        await post(pool, f"http://127.0.0.1:{port}")
    # A listener whose accept queue is full drops new SYNs: the connect hangs.
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    port = lst.getsockname()[1]
    fillers = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(c)
    await asyncio.sleep(0.05)
    try:
        t0 = time.monotonic()
        with pytest.raises(UpstreamConnectError, match="timed out"):
            await post(pool, f"http://127.0.0.1:{port}")
        assert time.monotonic() - t0 < 1.5
    finally:
        for c in fillers:
            c.close()
        lst.close()
    assert pool.connections() == []
    await pool.close()


async def _cancelled_request_closes_its_connection() -> None:
    async def script(conn, n, head, body, w):
        if conn == 1:
            await asyncio.sleep(5)  # the client gives up first
        w.write(ok_response())

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        task = asyncio.ensure_future(post(pool, url))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle(pool)
        assert pool.connections() == []
        # An abandoned half-read stream closes its connection too.
        assert await (await post(pool, url)).read() == b'{"ok": true}'
        await pool.close()


async def _abandoned_stream_closes_and_engine_sees_it() -> None:
    gone = asyncio.Event()

    async def script(conn, n, head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
        await w.drain()
        try:
            for _ in range(200):
                await asyncio.sleep(0.01)
                w.write(b"3\r\ntwo\r\n")
                await w.drain()
        except ConnectionError:
            gone.set()
            raise

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        r = await post(pool, url)
        assert await r.read_chunk() == b"one"
        r.close()
        await asyncio.wait_for(gone.wait(), 5)
        await settle(pool)
        assert pool.connections() == []
        await pool.close()


async def _slow_reader_pauses_the_engine() -> None:
    total = 4 * 1024 * 1024
    piece = b"z" * 65536

    async def script(conn, n, head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        for _ in range(total // len(piece)):
            w.write(piece)
            await w.drain()

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        r = await post(pool, url)
        got = len(await r.read_chunk())
        await asyncio.sleep(0.3)  # not reading: the pool must stop reading too
        buffered = r._size
        assert buffered <= HIGH_WATER + 1024 * 1024, buffered
        while chunk := await r.read_chunk():
            got += len(chunk)
        assert got == total and r.at_eof
        await settle(pool)
        assert pool.idle_count() == 1
        await pool.close()


async def _many_concurrent_requests_share_few_connections() -> None:
    async def script(conn, n, head, body, w):
        await asyncio.sleep(0.001)
        w.write(ok_response(body))

    async with raw_server(script) as (url, seen):
        pool = UpstreamPool()

        async def one(i: int) -> None:
            for j in range(10):
                r = await post(pool, url, b"%d-%d" % (i, j))
                assert await r.read() == b"%d-%d" % (i, j)

        await asyncio.gather(*(one(i) for i in range(16)))
        assert seen.connections <= 16
        assert len(seen.requests) == 160
        await settle(pool)
        await pool.close()


async def _keepalive_expiry_and_close_fails_in_flight() -> None:
    async def script(conn, n, head, body, w):
        if n == 2:
            await asyncio.sleep(5)
        w.write(ok_response())

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool(keepalive_s=0.2)
        await (await post(pool, url)).read()
        assert pool.idle_count() == 1
        await asyncio.sleep(0.6)
        assert pool.idle_count() == 0 and pool.connections() == []  # expired
        await (await post(pool, url)).read()
        pending = asyncio.ensure_future(post(pool, url))  # conn 2, request 2: never answered
        await asyncio.sleep(0.05)
        await pool.close()
        with pytest.raises(UpstreamClosed):
            await pending
        assert pool.connections() == []
        with pytest.raises(UpstreamConnectError):
            await post(pool, url)


async def _head_in_small_pieces() -> None:
    head = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 30000 + b"\r\nContent-Length: 2\r\n\r\nok"

    async def script(conn, n, head_in, body, w):
        for i in range(0, len(head), 5):
            w.write(head[i : i + 5])
            if i % 500 == 0:
                await w.drain()
                await asyncio.sleep(0)

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        t0 = time.monotonic()
        r = await post(pool, url)
        assert r.header("x-pad") == "p" * 30000 and await r.read() == b"ok"
        assert time.monotonic() - t0 < 5
        await settle(pool)
        assert pool.idle_count() == 1
        await pool.close()


async def _push_mode_delivers_in_order_with_the_end() -> None:
    """stream_to: every piece reaches the sink as it arrives (none waits for a reader), the last
    piece comes with ``last=True``, for chunked and Content-Length bodies, and what arrived
    before stream_to is handed over first."""
    step = asyncio.Event()

    async def script(conn, n, head, body, w):
        if n == 1:  # chunked, in three writes; the second only once the first was relayed
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
            await w.drain()
            await asyncio.wait_for(step.wait(), 5)
            w.write(b"3\r\ntwo\r\n")
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(b"5\r\nthree\r\n0\r\n\r\n")  # the last piece and the end together
        else:  # Content-Length in two writes
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nabc")
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(b"def")

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        got: list[tuple[bytes, bool]] = []

        def sink(piece: bytes, last: bool) -> bool:
            got.append((piece, last))
            if piece == b"one":
                step.set()
            return True

        r = await post(pool, url)
        await asyncio.sleep(0.05)  # "one" has arrived and waits in the response
        r.stream_to(sink)
        assert got == [(b"one", False)]
        await r.relayed()
        assert got == [(b"one", False), (b"two", False), (b"three", True)] and r.at_eof
        got.clear()
        r = await post(pool, url)
        r.stream_to(sink)
        await r.relayed()
        assert b"".join(p for p, _ in got) == b"abcdef" and got[-1] == (b"def", True)
        await settle(pool)
        assert pool.idle_count() == 1  # both answers ended cleanly: the connection is reused
        await pool.close()


async def _push_mode_holds_the_engine_while_the_sink_is_full() -> None:
    """A sink that says "full" pauses reading from the engine (``held``) until release()."""
    total = 4 * 1024 * 1024
    piece = b"z" * 65536
    sent = 0

    async def script(conn, n, head, body, w):
        nonlocal sent
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        for _ in range(total // len(piece)):
            w.write(piece)
            await w.drain()
            sent += len(piece)

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        got = 0
        ends = 0

        def sink(data: bytes, last: bool) -> bool:
            nonlocal got, ends
            got += len(data)
            ends += last
            return False  # always "full": one release per read from the engine

        r = await post(pool, url)
        r.stream_to(sink)
        await r.relayed()
        assert r.held and not r.complete
        await asyncio.sleep(0.3)  # held: the engine is stopped by the socket buffers
        assert sent < total and got < total
        seen = got
        await asyncio.sleep(0.2)
        assert got == seen  # nothing more was read while held
        releases = 0
        while not r.complete:
            r.release()
            releases += 1
            await r.relayed()
        assert got == total and ends == 1 and releases > 1
        await settle(pool)
        assert pool.idle_count() == 1
        await pool.close()


async def _push_mode_reports_a_break_mid_body() -> None:
    async def script(conn, n, head, body, w):
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n")
        await w.drain()
        await asyncio.sleep(0.05)
        reset(w)
        return "close"

    async with raw_server(script) as (url, _seen):
        pool = UpstreamPool()
        got: list[tuple[bytes, bool]] = []
        r = await post(pool, url)
        r.stream_to(lambda piece, last: got.append((piece, last)) or True)
        with pytest.raises(UpstreamClosed):
            await r.relayed()
        assert got == [(b"one", False)]  # no end was signalled
        await settle(pool)
        assert pool.connections() == []
        await pool.close()


SCENARIOS = {
    f.__name__.lstrip("_"): f
    for f in (
        _content_length_keep_alive_and_request_bytes,
        _chunked_streams_arrive_as_sent,
        _body_until_close_http10_and_interim,
        _server_closing_idle_connections,
        _keep_alive_race_is_retried_once_on_a_new_connection,
        _fresh_connection_closed_before_answer_is_an_error,
        _reset_mid_body,
        _truncated_bodies,
        _garbage_oversized_and_bad_framing,
        _extra_bytes_after_a_response_are_not_kept,
        _idle_timeout_before_and_during_the_body,
        _connect_refused_and_connect_timeout,
        _cancelled_request_closes_its_connection,
        _abandoned_stream_closes_and_engine_sees_it,
        _slow_reader_pauses_the_engine,
        _many_concurrent_requests_share_few_connections,
        _keepalive_expiry_and_close_fails_in_flight,
        _head_in_small_pieces,
        _push_mode_delivers_in_order_with_the_end,
        _push_mode_holds_the_engine_while_the_sink_is_full,
        _push_mode_reports_a_break_mid_body,
    )
}


@pytest.mark.parametrize("loop_factory", LOOPS)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_upstream_client(name: str, loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    run(loop_factory, SCENARIOS[name]())


def test_reset_helper_sends_rst() -> None:
    """The misbehaving server's reset really is a reset (the scenarios above rely on it)."""

    async def main() -> None:
        async def script(conn, n, head, body, w):
            reset(w)
            return "close"

        async with raw_server(script) as (url, _):
            _host, port = url.rsplit(":", 1)
            reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(), 5)
            writer.close()

    asyncio.run(main())


def test_https_engine(tmp_path) -> None:
    """An https:// engine: TLS with server-name check, keep-alive reuse as over plain TCP."""
    import shutil
    import ssl
    import subprocess

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))

    async def main() -> None:
        conns = 0

        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal conns
            conns += 1
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(ok_response(b"secure"))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(ssl_context=client_ctx)
        try:
            for _ in range(3):
                r = await pool.request(make_target(f"https://127.0.0.1:{port}", "/health"), b"GET")
                assert await r.read() == b"secure"
            assert conns == 1
            untrusted = UpstreamPool()  # the system's CAs do not know this certificate
            with pytest.raises(UpstreamConnectError):
                await untrusted.request(make_target(f"https://127.0.0.1:{port}", "/"), b"GET")
            await untrusted.close()
        finally:
            await pool.close()
            server.close()

    asyncio.run(asyncio.wait_for(main(), 30))
