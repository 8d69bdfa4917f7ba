"""The gateway's own HTTP/1.1 server, on an asyncio Protocol.

Why not aiohttp's server: on a proxied request that takes the engine a few microseconds, the
server side of aiohttp (request and response objects, stream readers, middleware and router
layers, a task and a payload writer per request) was a third of the gateway's CPU and about
0.1 ms of the latency it adds. The gateway needs a small part of it: read whole requests with a
size limit, hand them to a coroutine, write whole or chunked answers. What this server does:

* **Requests**: the head parsed once (strict: request line, header syntax, no obsolete line
  folding; a bare LF ends a line as CRLF does; over ``max_head_bytes`` -> 431), bodies framed
  by ``Content-Length`` or ``Transfer-Encoding: chunked`` (both at once -> 400, another
  transfer coding -> 501), read
  whole before the handler runs, over ``max_body_bytes`` -> 413 (``Expect: 100-continue`` is
  answered only when the declared size fits). Keep-alive (HTTP/1.1 by default, HTTP/1.0 on
  request) and pipelining (answered in order, one at a time).
* **Answers**: :class:`Response` in one write (head and body); :class:`StreamResponse` chunked,
  its head sent with the first piece, and the last piece with the end of the body. Writes wait
  while the client's socket buffer is full (flow control).
* **Cancellation**: a client that disconnects cancels its handler's task (which closes the
  upstream connection, so the engine stops generating).
* **Timeouts**: a connection with no request in progress and no byte for ``keepalive_s`` is
  closed. A request's whole head must arrive within ``head_timeout_s`` of its first byte, and
  its whole body within ``body_timeout_s`` of the end of its head, else 408 and the connection
  closed: a client that trickles a byte now and then cannot hold a connection. One sweeper per
  server checks all of this, not a timer per request; a request that arrives in one read costs
  nothing (its clock starts only when a head or body is left incomplete).
* **Connection cap**: over ``max_connections`` open connections, a new one is answered 503 with
  ``Retry-After`` and closed at once. ``ConnectionStats`` counts open, refused and timed-out
  connections (the gateway exports them as metrics).
* **Shutdown** (:meth:`HttpServer.shutdown`): stop listening, close idle connections, let
  requests in progress finish for up to the drain timeout (their connections close after the
  answer), then cancel what is left.
* **Never a crash**: malformed input gets a JSON error and the connection closed; an exception in
  a handler is logged and answered 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote, urlsplit

from gateway.config import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, MAX_CONNECTIONS
from gateway.upstream import ChunkedDecoder

log = logging.getLogger("kvgate.gateway.http")

MAX_HEAD_BYTES = 64 * 1024
MAX_PIPELINED = 16  # complete requests queued behind the one being answered
KEEPALIVE_S = 75.0
LINGER_S = 1.0  # a connection refused mid-request is closed this long after its answer

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(_TOKEN + rb" ([^\x00-\x20\x7f]+) HTTP/1\.([01])")
_FIELDS = re.compile(rb"(?:" + _TOKEN + rb":[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")

Handler = Callable[["Request"], Awaitable["Response | StreamResponse"]]
ErrorFactory = Callable[[int, str], "Response"]


class ConnectionStats:
    """What a server's connection limits did (shared by the servers of one gateway, read on
    scrape)."""

    __slots__ = ("body_timeouts", "head_timeouts", "open", "refused")

    def __init__(self) -> None:
        self.open = 0  # connections open now
        self.refused = 0  # connections answered 503 and closed: over the cap
        self.head_timeouts = 0  # requests whose head did not arrive in time (408)
        self.body_timeouts = 0  # requests whose body did not arrive in time (408)


class HttpError(Exception):
    """A request the server refuses before any handler runs."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ---- requests ---------------------------------------------------------------------------------


class Request:
    """One complete request. ``fields``: the header lines as received (names lower-cased,
    bytes, in order, repeats kept) for forwarding; ``headers``: the first value of each, as
    text (UTF-8 with surrogate escapes, so any byte survives a round trip)."""

    __slots__ = (
        "_conn",
        "body",
        "error",
        "fields",
        "headers",
        "http11",
        "keep_alive",
        "match_info",
        "method",
        "path",
        "query",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        http11: bool,
        fields: list[tuple[bytes, bytes]],
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.http11 = http11
        self.fields = fields
        headers: dict[str, str] = {}
        for name, value in fields:
            key = name.decode("ascii")
            if key not in headers:
                headers[key] = value.decode("utf-8", "surrogateescape")
        self.headers = headers
        conn = headers.get("connection")
        if conn is None:
            self.keep_alive = http11
        else:
            tokens = {t.strip().lower() for t in conn.split(",")}
            self.keep_alive = "close" not in tokens and (http11 or "keep-alive" in tokens)
        self.body = b""
        self.match_info: dict[str, str] = {}
        self.error: HttpError | None = None
        self._conn: _ServerConn | None = None


def head_end(buf: bytes | bytearray, start: int = 0) -> tuple[int, int]:
    """Where the head in ``buf`` ends: (its length, where the body starts), or (-1, -1) while
    its blank line has not arrived. A line may end in a bare LF (RFC 9112 section 2.2 lets a
    server take one for CRLF), so the blank line is the first LF followed by CRLF or LF;
    ``start``: where to look from (the head's earlier bytes were looked at already)."""
    crlf = buf.find(b"\n\r\n", start)
    lf = buf.find(b"\n\n", start, crlf + 2 if crlf >= 0 else len(buf))
    if lf >= 0:
        return (lf - 1 if lf and buf[lf - 1] == 13 else lf), lf + 2
    if crlf >= 0:
        return (crlf - 1 if crlf and buf[crlf - 1] == 13 else crlf), crlf + 3
    return -1, -1


def parse_request_head(head: bytes) -> Request:
    """A request head (without its final blank line) -> :class:`Request`; HttpError if
    malformed. Lines may end in CRLF or a bare LF (read as CRLF). Pure."""
    if head.count(b"\n") != head.count(b"\r\n"):  # bare LFs: CRLF from here on
        head = head.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    eol = head.find(b"\r\n")
    line, block = (head, b"") if eol < 0 else (head[:eol], head[eol + 2 :] + b"\r\n")
    m = _REQUEST_LINE.fullmatch(line)
    if m is None:
        if line.startswith(b"PRI * HTTP/2"):
            raise HttpError(505, "HTTP/2 without upgrade is not supported; use HTTP/1.1")
        if re.fullmatch(_TOKEN + rb" \S+ HTTP/\d\.\d", line):
            raise HttpError(505, "HTTP version not supported")
        raise HttpError(400, f"malformed request line {line[:100]!r}")
    if block and _FIELDS.fullmatch(block) is None:
        raise HttpError(400, "malformed header field")
    method = line[: line.index(b" ")].decode("ascii")
    target = m.group(1).decode("latin-1")
    if not target.startswith("/"):
        if target.startswith(("http://", "https://")):  # absolute form: keep the path
            try:
                parts = urlsplit(target)
            except ValueError:  # e.g. an unclosed IPv6 bracket: "http://[/health"
                raise HttpError(400, f"bad request target {target[:100]!r}") from None
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        elif not (target == "*" and method == "OPTIONS"):
            raise HttpError(400, f"bad request target {target[:100]!r}")
    path, _, query = target.partition("?")
    return Request(method, path, query, m.group(2) == b"1", split_fields(block))


def split_fields(block: bytes) -> list[tuple[bytes, bytes]]:
    """Header lines already validated by ``_FIELDS`` -> (lower-cased name, value) pairs."""
    fields = []
    for line in block[:-2].split(b"\r\n") if block else ():
        name, _, value = line.partition(b":")
        fields.append((name.lower(), value.strip(b" \t")))
    return fields


def body_framing(req: Request) -> tuple[int | None, bool]:
    """(Content-Length or None, chunked) of a request; HttpError when ambiguous or unsupported."""
    length: int | None = None
    te: list[bytes] = []
    for name, value in req.fields:
        if name == b"content-length":
            if not value.isdigit() or len(value) > 18:
                raise HttpError(400, "bad Content-Length")
            n = int(value)
            if length is not None and n != length:
                raise HttpError(400, "conflicting Content-Length headers")
            length = n
        elif name == b"transfer-encoding":
            te += (c.strip().lower() for c in value.split(b","))
    if not te:
        return length, False
    if length is not None:  # a classic request-smuggling shape: refuse it
        raise HttpError(400, "both Content-Length and Transfer-Encoding")
    if te != [b"chunked"] or not req.http11:
        raise HttpError(501, "only Transfer-Encoding: chunked is supported")
    return None, True


# ---- responses --------------------------------------------------------------------------------

_REASONS: dict[int, bytes] = {s.value: s.phrase.encode() for s in HTTPStatus}
_date_at = 0
_date_line = b""


def _date() -> bytes:
    """The ``Date`` header line, formatted once per second."""
    global _date_at, _date_line
    now = int(time.time())
    if now != _date_at:
        _date_at = now
        _date_line = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date_line


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


def encode_header_lines(headers: Iterable[tuple[str, str]]) -> bytes:
    """Header lines from text pairs. Values are expected to come from parsed (hence CR/LF-free)
    input or from the gateway itself; a pair holding CR or LF is dropped, never sent."""
    out = []
    for k, v in headers:
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
            continue
        out.append(f"{k}: {v}\r\n")
    return "".join(out).encode("utf-8", "surrogateescape")


class Response:
    """A whole answer, sent in one write. ``raw_headers``: header lines already encoded (the
    proxy relays the engine's this way); ``headers``: text pairs, encoded on send."""

    __slots__ = ("body", "headers", "raw_headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        *,
        content_type: str | None = None,
        raw_headers: bytes = b"",
    ) -> None:
        self.status = status
        self.body = body
        pairs = list(headers.items() if isinstance(headers, Mapping) else headers or ())
        if content_type is not None:
            pairs.append(("Content-Type", content_type))
        self.headers = pairs
        self.raw_headers = raw_headers

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (tests and logs)."""
        lname = name.lower()
        for k, v in self.headers:
            if k.lower() == lname:
                return v
        return None

    def encode(self, keep_alive: bool, http11: bool, head_only: bool) -> bytes:
        parts = [_status_line(self.status), self.raw_headers]
        if self.headers:
            parts.append(encode_header_lines(self.headers))
        parts.append(b"Content-Length: %d\r\n" % len(self.body))
        parts.append(_date())
        if not keep_alive:
            parts.append(b"Connection: close\r\n")
        elif not http11:
            parts.append(b"Connection: keep-alive\r\n")
        parts.append(b"\r\n")
        if not head_only:
            parts.append(self.body)
        return b"".join(parts)


def json_response(
    body: bytes, status: int = 200, headers: Iterable[tuple[str, str]] = ()
) -> Response:
    """A JSON answer from bytes already encoded (orjson)."""
    return Response(status, body, [("Content-Type", "application/json"), *headers])


class StreamResponse:
    """A chunked answer written as it is produced. Nothing is sent by :meth:`prepare`: the head
    goes out with the first :meth:`write` (one packet and one client wake-up rather than two),
    and :meth:`write_eof` sends the last piece together with the end of the body."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_head_only",
        "_keep_alive",
        "_started",
        "finished",
        "headers",
        "status",
    )

    def __init__(
        self,
        status: int = 200,
        headers: Iterable[tuple[str, str]] | None = None,
        *,
        raw_headers: bytes = b"",
    ) -> None:
        self.status = status
        self.headers = raw_headers + encode_header_lines(headers or ())
        self._conn: _ServerConn | None = None
        self._started = False
        self._chunked = True
        self._head_only = False
        self._keep_alive = True
        self.finished = False

    async def prepare(self, request: Request) -> None:
        self._conn = request._conn
        self._chunked = request.http11
        self._head_only = request.method == "HEAD"
        self._keep_alive = request.keep_alive

    def _head(self, keep_alive: bool) -> bytes:
        parts = [_status_line(self.status), self.headers, _date()]
        if self._chunked:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        if not keep_alive or not self._chunked:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _frame(self, data: bytes, last: bool) -> bytes:
        conn = self._conn
        if conn is None:
            raise RuntimeError("StreamResponse.prepare() was not called")
        out = b""
        if not self._started:
            self._started = True
            conn.streaming = True
            out = self._head(self._keep_alive and conn.will_keep_alive())
        if self._head_only:
            return out
        if self._chunked:
            if data:
                out += b"%x\r\n" % len(data) + data + b"\r\n"
            if last:
                out += b"0\r\n\r\n"
        else:
            out += data
        return out

    def send(self, data: bytes, last: bool = False) -> bool:
        """Send ``data`` now (``last``: and end the body), from any callback; returns False
        while the client's socket buffer is full (await :meth:`drain` before sending more).
        Raises ConnectionResetError once the client has gone."""
        conn = self._conn
        if conn is None or conn.closed or conn.transport.is_closing():
            raise ConnectionResetError("client connection closed")
        if self.finished:
            return True
        if last:
            self.finished = True
        elif not data and self._started:
            return not conn.write_paused
        conn.transport.write(self._frame(data, last))
        return not conn.write_paused

    async def drain(self) -> None:
        """Wait until the client's socket buffer has room again."""
        conn = self._conn
        if conn is not None and conn.write_paused:
            await conn.drain()

    async def write(self, data: bytes) -> None:
        """Send ``data`` now; waits while the client's socket buffer is full. Raises
        ConnectionResetError once the client has gone."""
        if not self.send(data):
            await self.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        """Send ``data`` (if any) and end the body."""
        if self.finished:
            return
        if not self.send(data, True):
            await self.drain()


# ---- routing ----------------------------------------------------------------------------------


class Routes:
    """Exact paths, and a few patterns (``{name}`` segments), to handlers by method."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Handler]] = {}
        self._patterns: list[tuple[re.Pattern[str], dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        if "{" in path:
            rx = re.compile(
                "^"
                + re.sub(
                    r"\{(\w+)(?::([^}]+))?\}",
                    lambda m: f"(?P<{m.group(1)}>{m.group(2) or '[^/]+'})",
                    path,
                )
                + "$"
            )
            for pat, methods in self._patterns:
                if pat.pattern == rx.pattern:
                    methods[method] = handler
                    return
            self._patterns.append((rx, {method: handler}))
        else:
            self._exact.setdefault(path, {})[method] = handler

    def resolve(self, method: str, path: str) -> tuple[Handler | None, dict[str, str], list[str]]:
        """(handler, path parameters, allowed methods); handler None: 404 (no allowed
        methods) or 405."""
        methods = self._exact.get(path)
        params: dict[str, str] = {}
        if methods is None:
            for rx, ms in self._patterns:
                m = rx.match(path)
                if m is not None:
                    methods = ms
                    params = {k: unquote(v) for k, v in m.groupdict().items()}
                    break
            else:
                return None, params, []
        h = methods.get(method)
        if h is None and method == "HEAD":
            h = methods.get("GET")
        return h, params, sorted(methods)


# ---- the connection ---------------------------------------------------------------------------


class _ServerConn(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers one at a time, writes the
    answers in order."""

    __slots__ = (
        "_acc",
        "_body_len",
        "_body_parts",
        "_buf",
        "_chunks",
        "_close_after",
        "_drain_waiter",
        "_pending",
        "_queue",
        "_read_paused",
        "_remaining",
        "_scan",
        "_since",
        "_task",
        "closed",
        "server",
        "streaming",
        "ticks",
        "transport",
        "write_paused",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set on connect
        self.closed = False
        self.ticks = 0
        self.write_paused = False
        self.streaming = False  # the current answer is a stream that has started
        self._buf = b""  # bytes to parse now
        self._acc: bytearray | None = None  # an incomplete head, growing
        self._scan = 0  # where in _acc to look for the end of the head next
        self._since = 0.0  # when the incomplete head (_acc) or body (_pending) began
        self._pending: Request | None = None  # a request whose body is still arriving
        self._remaining = 0
        self._chunks: ChunkedDecoder | None = None
        self._body_parts: list[bytes] = []
        self._body_len = 0
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._close_after = False  # stop reading: answer what is queued, then close
        self._read_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport
        server = self.server
        if len(server.connections) >= server.max_connections:
            self._close_after = True
            server.stats.refused += 1
            answer = server.error(503, f"over {server.max_connections} open connections")
            answer.headers.append(("Retry-After", "1"))
            self.transport.write(answer.encode(False, True, False))
            self._close_lingering()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server.connections.add(self)
        server.stats.open += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.server.connections:
            self.server.connections.discard(self)
            self.server.stats.open -= 1
        self._queue.clear()
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # the client went away: so does its request (and the upstream one)
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError("client connection closed"))
        self.server._changed()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def drain(self) -> None:
        if self.write_paused and not self.closed:
            w = self._drain_waiter = self.server.loop.create_future()
            await w

    def data_received(self, data: bytes) -> None:
        self.ticks = 0
        if self._close_after:
            return
        try:
            if self._pending is not None:
                self._feed_body(data)
            elif self._acc is not None:
                self._grow(data)
            else:
                self._buf = data
                self._parse()
        except Exception:  # a bug here must cost one connection, never the process
            log.exception("HTTP connection failed")
            self.transport.abort()

    def _close_lingering(self) -> None:
        """Close a connection whose client may still be sending (a refused request): FIN after
        the answer, then read and drop for up to ``LINGER_S``. Closing with unread bytes would
        send RST, which can destroy the answer before the client reads it."""
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
            self.server.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def eof_received(self) -> bool:
        # A client that half-closes after its request is treated as gone (as aiohttp does).
        return False

    # -- reading requests --

    def _grow(self, data: bytes) -> None:
        """More of an incomplete head: append (amortized O(1)) and look for its end only in
        the new bytes, so that a head sent a byte at a time costs linear, not quadratic, time."""
        acc = self._acc
        assert acc is not None
        acc += data
        end, _ = head_end(acc, self._scan)
        if end < 0:
            if len(acc) > self.server.max_head_bytes:
                self._acc = None
                self._refuse(HttpError(431, "request head too large"))
            else:
                self._scan = max(0, len(acc) - 3)
            return
        self._acc = None
        self._scan = 0
        self._buf = bytes(acc)
        self._parse()

    def _parse(self) -> None:
        server = self.server
        while self._buf and not self._close_after and self._pending is None:
            buf = self._buf
            if buf.startswith((b"\r\n", b"\n")):  # empty lines before a request are ignored
                self._buf = buf.lstrip(b"\r\n")  # (RFC 9112)
                continue
            end, body_at = head_end(buf)
            if end < 0 or end > server.max_head_bytes:
                if len(buf) > server.max_head_bytes:
                    self._refuse(HttpError(431, "request head too large"))
                else:  # wait for the rest of the head
                    self._since = server.loop.time()
                    self._acc = bytearray(buf)
                    self._scan = max(0, len(buf) - 3)
                    self._buf = b""
                return
            try:
                req = parse_request_head(buf[:end])
                length, chunked = body_framing(req)
            except HttpError as exc:
                self._refuse(exc)
                return
            rest = buf[body_at:]
            self._buf = b""
            if chunked:
                self._since = server.loop.time()
                self._pending = req
                self._chunks = ChunkedDecoder()
                self._body_parts = []
                self._body_len = 0
                self._continue(req)
                if rest:
                    self._feed_body(rest)
                return
            if not length:
                self._buf = rest
                self._enqueue(req)
                continue
            if length > server.max_body_bytes:
                self._refuse(HttpError(413, f"request body exceeds {server.max_body_bytes} bytes"))
                return
            if len(rest) >= length:
                req.body = rest if len(rest) == length else rest[:length]
                self._buf = rest[length:]
                self._enqueue(req)
                continue
            self._since = server.loop.time()
            self._pending = req
            self._remaining = length - len(rest)
            self._body_parts = [rest] if rest else []
            self._continue(req)
            return

    def _continue(self, req: Request) -> None:
        """Answer ``Expect: 100-continue`` (only reached when the declared body fits)."""
        expect = req.headers.get("expect")
        if expect is not None and req.http11 and expect.lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _feed_body(self, data: bytes) -> None:
        req = self._pending
        assert req is not None
        dec = self._chunks
        if dec is None:
            n = len(data)
            if n < self._remaining:
                self._remaining -= n
                self._body_parts.append(data)
                return
            rem = self._remaining
            self._body_parts.append(data[:rem] if n > rem else data)
            tail = data[rem:]
        else:
            try:
                pieces = dec.feed(data)
            except ValueError as exc:
                self._pending = None
                self._refuse(HttpError(400, f"bad chunked body: {exc}"))
                return
            for p in pieces:
                self._body_parts.append(p)
                self._body_len += len(p)
            limit = self.server.max_body_bytes
            if self._body_len > limit:
                self._pending = None
                self._refuse(HttpError(413, f"request body exceeds {limit} bytes"))
                return
            if not dec.done:
                return
            tail = dec.tail
            self._chunks = None
        parts = self._body_parts
        req.body = parts[0] if len(parts) == 1 else b"".join(parts)
        self._body_parts = []
        self._pending = None
        self._buf = tail
        self._enqueue(req)
        self._parse()

    def check_deadlines(self, now: float) -> None:
        """Refuse (408) a request whose head or body is late; the sweeper calls this. Not while
        reading is paused: then the wait is the server's, not the client's."""
        if self._read_paused or self._close_after:
            return
        server = self.server
        if self._acc is not None and now - self._since > server.head_timeout_s:
            self._acc = None
            server.stats.head_timeouts += 1
            late = f"request head not received in {server.head_timeout_s:g} s"
            self._refuse(HttpError(408, late))
        elif self._pending is not None and now - self._since > server.body_timeout_s:
            self._pending = None
            self._chunks = None
            self._body_parts = []
            server.stats.body_timeouts += 1
            late = f"request body not received in {server.body_timeout_s:g} s"
            self._refuse(HttpError(408, late))

    def _refuse(self, exc: HttpError) -> None:
        """A request the server cannot take: answer it (after those queued) and close."""
        req = Request("GET", "", "", True, [])
        req.error = exc
        req.keep_alive = False
        self._enqueue(req)
        self._close_after = True
        self._buf = b""

    def _enqueue(self, req: Request) -> None:
        req._conn = self
        if self._task is None:
            self._task = self.server.loop.create_task(self._respond(req))
            return
        self._queue.append(req)
        if len(self._queue) >= MAX_PIPELINED and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    # -- answering --

    def will_keep_alive(self) -> bool:
        """May the answer being sent leave the connection open? Not while shutting down, nor
        once reading has stopped (``_close_after``) with nothing queued behind it: the
        answers queued behind it (a refusal last among them) still go out on this
        connection, in order."""
        return not self.server.closing and (not self._close_after or bool(self._queue))

    async def _respond(self, req: Request) -> None:
        server = self.server
        keep = req.keep_alive
        try:
            if req.error is not None:
                resp: Response | StreamResponse = server.error(req.error.status, req.error.message)
                keep = False
            else:
                handler = server.resolve(req)
                if isinstance(handler, Response):
                    resp = handler
                else:
                    try:
                        resp = await handler(req)
                    except (asyncio.CancelledError, ConnectionResetError):
                        raise
                    except Exception:
                        log.exception("unhandled error on %s", req.path)
                        resp = server.error(500, "internal gateway error (logged)")
            keep = keep and self.will_keep_alive()
            if isinstance(resp, StreamResponse):
                if resp._conn is None:
                    await resp.prepare(req)
                if not resp.finished and not self.closed:
                    await resp.write_eof()
                keep = keep and resp._chunked
            elif self.streaming:  # a handler that failed after starting a stream
                keep = False
                self.transport.abort()
            elif not self.closed and not self.transport.is_closing():
                self.transport.write(resp.encode(keep, req.http11, req.method == "HEAD"))
                # a client that pipelines requests without reading the answers: the next one
                # waits until it reads (the queue then fills and reading pauses), or the
                # answers would pile up in memory without bound
                await self.drain()
        except asyncio.CancelledError:
            keep = False
            if not self.closed:  # cancelled by a shutdown that ran out of time
                self.transport.abort()
            raise
        except ConnectionResetError:
            keep = False
        except Exception:  # a bug in answering: lose this connection, never the server
            log.exception("failed to answer %s %s", req.method, req.path)
            keep = False
            self.transport.abort()
        finally:
            self._task = None
            self.streaming = False
            self.ticks = 0
            server._changed()
        if self.closed:
            return
        if not keep:
            if self._close_after:
                self._close_lingering()
            else:
                self.transport.close()
            return
        if self._queue:
            nxt = self._queue.popleft()
            if self._read_paused and len(self._queue) < MAX_PIPELINED // 2:
                self._read_paused = False
                self.transport.resume_reading()
            self._task = server.loop.create_task(self._respond(nxt))

    @property
    def busy(self) -> bool:
        """A request of this connection is being answered (a body still arriving is not:
        a client that stops sending mid-body is as idle as one that sends nothing)."""
        return self._task is not None


# ---- the server -------------------------------------------------------------------------------


class HttpServer:
    """Listening socket(s), connections and the route table; see the module docstring."""

    def __init__(
        self,
        routes: Routes,
        *,
        error: ErrorFactory,
        max_body_bytes: int,
        max_head_bytes: int = MAX_HEAD_BYTES,
        keepalive_s: float = KEEPALIVE_S,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        stats: ConnectionStats | None = None,
    ) -> None:
        if min(keepalive_s, head_timeout_s, body_timeout_s) <= 0 or max_connections < 1:
            raise ValueError("HTTP server timeouts must be > 0 and max_connections >= 1")
        self.routes = routes
        self.error = error
        self.max_body_bytes = max_body_bytes
        self.max_head_bytes = max_head_bytes
        self.keepalive_s = keepalive_s
        self.head_timeout_s = head_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_connections = max_connections
        self.stats = stats if stats is not None else ConnectionStats()
        self.connections: set[_ServerConn] = set()
        self.closing = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._idle_event: asyncio.Event | None = None

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Listen on host:port (0 = a free port); returns the bound port."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(
            lambda: _ServerConn(self),
            host,
            port,
            reuse_address=True,
            reuse_port=reuse_port or None,
        )
        self._sweeper = self.loop.create_task(self._sweep())
        return self._server.sockets[0].getsockname()[1]

    def resolve(self, req: Request) -> Handler | Response:
        """The handler for ``req`` (its path parameters set), or the 404/405 answer."""
        handler, params, allowed = self.routes.resolve(req.method, req.path)
        if handler is None:
            if allowed:
                resp = self.error(405, f"method {req.method} not allowed on {req.path}")
                resp.headers.append(("Allow", ", ".join(allowed)))
                return resp
            return self.error(404, f"no route for {req.path}")
        req.match_info = params
        return handler

    def _changed(self) -> None:
        ev = self._idle_event
        if ev is not None and not any(c.busy for c in self.connections):
            ev.set()

    async def _sweep(self) -> None:
        """Close connections that have been idle (no request in progress, no byte) too long;
        refuse requests whose head or body is late."""
        shortest = min(self.keepalive_s, self.head_timeout_s, self.body_timeout_s)
        tick = max(0.05, min(1.0, shortest / 4))
        limit = self.keepalive_s / tick
        while True:
            await asyncio.sleep(tick)
            now = self.loop.time()
            for conn in list(self.connections):
                conn.check_deadlines(now)
                if conn.busy:
                    continue
                conn.ticks += 1
                if conn.ticks > limit:
                    conn.transport.close()

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Stop listening, let requests in progress finish (up to ``drain_timeout_s``), close
        every connection."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if not conn.busy:
                conn.transport.close()
        self._idle_event = asyncio.Event()
        self._changed()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_timeout_s):
                await self._idle_event.wait()
        tasks = [c._task for c in self.connections if c._task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in list(self.connections):
            conn.transport.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
