"""The gateway's own HTTP/1.1 client for the upstream hop: keep-alive connections per engine on
asyncio Protocols.

Why not ``aiohttp.ClientSession``: for a proxy whose upstream answers in a fraction of a
millisecond, its per-request machinery (request/response objects, stream readers, payload
registry, a timer re-armed per read) was about a sixth of the gateway's CPU. A proxy needs far
less: write the request head and body in one write, parse the response head once, hand the body
over as it arrives. What this client does:

* **Connections**: one pool per gateway, idle connections kept per origin (LIFO, so the hot ones
  are reused and the rest expire after ``keepalive_s``), no limit on open ones, TCP_NODELAY.
* **Framing**: ``Content-Length``, ``Transfer-Encoding: chunked`` (decoded; trailers dropped) and
  read-until-close; 1xx interim answers skipped. A head over ``max_head_bytes``, a malformed
  status line, header or chunk size, or conflicting lengths are an :class:`UpstreamProtocolError`
  and close the connection.
* **Streaming**: body pieces are handed to the reader as they arrive; reading from the engine
  pauses while the reader lags by more than ``HIGH_WATER`` bytes. A relay can instead take
  them in *push* mode (:meth:`UpstreamResponse.stream_to`): each piece goes to its sink from
  the connection's own ``data_received``, so a streamed token costs no task wake-up (one event
  loop iteration and a future) on its way to the client; the sink's "full" answer pauses
  reading from the engine until the relay has drained the client.
* **Timeouts**: ``connect_timeout_s`` per connection attempt; ``idle_timeout_s`` without a byte
  from the engine while an answer is awaited (checked by one sweeper task per pool rather than a
  timer per request).
* **The keep-alive race**: a reused connection that the engine closed while it sat idle fails
  before any byte of the answer; that request is sent again once on a new connection.
* **No leaks**: a connection goes back to the pool only when its answer was read to the end with
  valid framing; an answer abandoned midway (:meth:`UpstreamResponse.close`, or a cancelled
  caller) closes its connection, which is also how an engine learns that its client went away.

``parse_head`` and ``ChunkedDecoder`` are pure and tested on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

HIGH_WATER = 256 * 1024  # buffered body bytes at which reading from the engine pauses
MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 256 * 1024 * 1024  # a whole-body read larger than this is refused
MAX_CHUNK_LINE = 4096

# Connection states.
_IDLE, _HEAD, _BODY, _CLOSED = 0, 1, 2, 3
# Body framings.
_LENGTH, _CHUNKED, _UNTIL_CLOSE = 0, 1, 2

# Push mode: sink(piece, last) -> whether the client can take more (see UpstreamResponse.stream_to)
Sink = Callable[[bytes, bool], bool]

_HEX = frozenset(b"0123456789abcdefABCDEF")
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_FIELDS = re.compile(rb"(?:" + _TOKEN + rb":[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) (\d\d\d)(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")


class UpstreamError(Exception):
    """The upstream hop failed. ``before_response``: no byte of the answer had arrived (so
    the engine cannot have started answering this request on this connection)."""

    kind = "error"

    def __init__(self, message: str, *, before_response: bool = False) -> None:
        super().__init__(message)
        self.before_response = before_response


class UpstreamConnectError(UpstreamError):
    """The connection could not be opened (refused, unreachable, DNS, connect timeout)."""

    kind = "connect"


class UpstreamClosed(UpstreamError):
    """The engine closed or reset the connection before the answer was complete."""

    kind = "closed"


class UpstreamTimeout(UpstreamError):
    """No byte from the engine for ``idle_timeout_s`` while an answer was awaited."""

    kind = "timeout"


class UpstreamProtocolError(UpstreamError):
    """The engine's bytes are not valid HTTP/1.1 (or exceed a limit)."""

    kind = "protocol"


# ---- pure parsing ---------------------------------------------------------------------------


class Head:
    """A parsed response head. ``fields``: the header lines (names lower-cased, bytes, in
    order); ``length``: the Content-Length (None when absent or chunked). (A plain class: a
    frozen dataclass costs a microsecond per response to build.)"""

    __slots__ = ("chunked", "content_type", "fields", "keep_alive", "length", "reason", "status")

    def __init__(
        self,
        status: int,
        reason: str,
        fields: list[tuple[bytes, bytes]],
        chunked: bool,
        length: int | None,
        keep_alive: bool,
        content_type: bytes,
    ) -> None:
        self.status = status
        self.reason = reason
        self.fields = fields
        self.chunked = chunked
        self.length = length
        self.keep_alive = keep_alive
        self.content_type = content_type


def parse_head(head: bytes) -> Head:
    """Parse a response head (without its final blank line); ValueError when malformed.

    Strict where leniency lets bytes be misread as a different message (status line, header
    syntax, Content-Length, Transfer-Encoding), per RFC 9112."""
    eol = head.find(b"\r\n")
    line, block = (head, b"") if eol < 0 else (head[:eol], head[eol + 2 :] + b"\r\n")
    m = _STATUS_LINE.fullmatch(line)
    if m is None:
        raise ValueError(f"bad status line {line[:80]!r}")
    if block and _FIELDS.fullmatch(block) is None:
        raise ValueError("bad header field")
    status = int(m.group(2))
    if status < 100:
        raise ValueError(f"bad status code {status}")
    http11 = m.group(1) == b"1"
    fields = []
    for field in block[:-2].split(b"\r\n") if block else ():
        name, _, value = field.partition(b":")
        fields.append((name.lower(), value.strip(b" \t")))
    length: int | None = None
    chunked = has_te = False
    close = not http11
    content_type = b""
    for name, value in fields:
        if name == b"content-length":
            if not value.isdigit() or len(value) > 18:
                raise ValueError(f"bad Content-Length {value[:40]!r}")
            n = int(value)
            if length is not None and n != length:
                raise ValueError("conflicting Content-Length headers")
            length = n
        elif name == b"transfer-encoding":
            # Only "chunked": a transfer coding the gateway would have to undo (gzip, ...) is
            # refused rather than relayed as a body the client cannot read.
            if has_te or [c.strip().lower() for c in value.split(b",")] != [b"chunked"]:
                raise ValueError(f"unsupported Transfer-Encoding {value[:40]!r}")
            has_te = chunked = True
        elif name == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"close" in tokens:
                close = True
            elif not http11 and b"keep-alive" in tokens:
                close = False
        elif name == b"content-type":
            content_type = value
    if chunked:
        # Transfer-Encoding wins over Content-Length (RFC 9112 6.3); a message carrying both
        # may be an attempt at smuggling, so its connection is not reused.
        if length is not None:
            close = True
        length = None
    elif length is None and status not in (204, 304) and status >= 200:
        close = True  # no framing: the body runs until the engine closes
    reason = (m.group(3) or b"").decode("latin-1")
    return Head(status, reason, fields, chunked, length, not close, content_type)


class ChunkedDecoder:
    """Incremental decoder of a chunked body: ``feed`` returns the payload pieces in the bytes
    given, and sets ``done`` (with any bytes after the message in ``tail``) at the last chunk
    and its trailers. Raises ValueError on malformed framing."""

    __slots__ = ("_buf", "_remaining", "_state", "_trailer_bytes", "done", "tail")

    _SIZE, _DATA, _DATA_END, _TRAILER = 0, 1, 2, 3

    def __init__(self) -> None:
        self._buf = b""
        self._state = self._SIZE
        self._remaining = 0
        self._trailer_bytes = 0
        self.done = False
        self.tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        self._buf = b""
        out: list[bytes] = []
        pos = 0
        n = len(buf)
        state = self._state
        while pos < n:
            if state == self._DATA:
                take = min(self._remaining, n - pos)
                out.append(buf[pos : pos + take] if take != n or pos else buf)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    state = self._DATA_END
            elif state == self._SIZE:
                eol = _crlf(buf, pos)
                if eol < 0:
                    if n - pos > MAX_CHUNK_LINE:
                        raise ValueError("chunk size line too long")
                    break
                size = buf[pos:eol].split(b";", 1)[0].strip(b" \t")
                if not size or len(size) > 15 or not all(c in _HEX for c in size):
                    raise ValueError(f"bad chunk size {buf[pos:eol][:40]!r}")
                pos = eol + 2
                self._remaining = int(size, 16)
                state = self._DATA if self._remaining else self._TRAILER
            elif state == self._DATA_END:
                if n - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                pos += 2
                state = self._SIZE
            else:  # trailers: header lines up to an empty line, dropped
                eol = _crlf(buf, pos)
                if eol < 0:
                    if n - pos > MAX_CHUNK_LINE or self._trailer_bytes + n - pos > MAX_HEAD_BYTES:
                        raise ValueError("chunked trailer too large")
                    break
                self._trailer_bytes += eol + 2 - pos
                if self._trailer_bytes > MAX_HEAD_BYTES:
                    raise ValueError("chunked trailers too large")
                if eol == pos:
                    self.done = True
                    self.tail = buf[eol + 2 :]
                    self._state = state
                    return out
                pos = eol + 2
        self._state = state
        if pos < n:
            self._buf = buf[pos:]
        return out


def _crlf(buf: bytes, pos: int) -> int:
    """Where the line from ``pos`` ends (its CR), -1 while it is incomplete; raises ValueError
    on a line ended by a bare LF, which no more bytes can make valid (waiting for a CRLF, such
    a request was refused only at the body timeout)."""
    lf = buf.find(b"\n", pos)
    if lf < 0:
        return -1
    if lf == pos or buf[lf - 1] != 13:  # (13: CR)
        raise ValueError("chunked framing: a line ends in a bare LF")
    return lf - 1


# ---- targets ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Origin:
    """Where connections go: scheme, host and port (the pool's key)."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Target:
    """An origin and a request target on it, with the ``Host`` header, encoded once."""

    origin: Origin
    path: bytes
    host_header: bytes


def make_target(base_url: str, path: str) -> Target:
    """``base_url`` (``http[s]://host[:port][/prefix]``) + ``path``; ValueError if unusable."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{base_url!r} is not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    full = (parts.path.rstrip("/") + path) or "/"
    return Target(
        Origin(parts.scheme, parts.hostname, port),
        full.encode("ascii"),
        parts.netloc.rpartition("@")[2].encode("ascii"),
    )


# ---- the response ---------------------------------------------------------------------------


class UpstreamResponse:
    """An answer whose head has arrived; its body arrives through :meth:`read` (all of it) or
    :meth:`read_chunk` (as it comes). Close it if it is not read to the end."""

    __slots__ = (
        "_conn",
        "_error",
        "_parts",
        "_sink",
        "_size",
        "_waiter",
        "_whole",
        "complete",
        "content_type",
        "fields",
        "held",
        "reason",
        "status",
    )

    def __init__(self, head: Head, conn: _Conn) -> None:
        self.status = head.status
        self.reason = head.reason
        self.fields = head.fields
        self.content_type = head.content_type
        self.complete = False
        self._conn: _Conn | None = conn
        self._parts: list[bytes] = []
        self._size = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._whole = False
        self._sink: Sink | None = None
        self.held = False  # push mode: reading paused until the sink's client drains

    @property
    def at_eof(self) -> bool:
        """Everything has arrived and been read."""
        return self.complete and not self._parts

    @property
    def is_event_stream(self) -> bool:
        return self.content_type[:17].lower() == b"text/event-stream"

    @property
    def headers(self) -> list[tuple[str, str]]:
        """The header lines as text (names lower-cased)."""
        return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self.fields]

    def header(self, name: str) -> str | None:
        """The first value of header ``name``, as text."""
        key = name.lower().encode("latin-1")
        for n, v in self.fields:
            if n == key:
                return v.decode("latin-1")
        return None

    # -- fed by the connection --

    def _push(self, piece: bytes) -> None:
        sink = self._sink
        if sink is not None:
            if not sink(piece, False) and not self.held:  # the client is full: stop reading
                self._hold()
                self._wake()
            return
        self._parts.append(piece)
        self._size += len(piece)
        conn = self._conn
        if self._size > HIGH_WATER and conn is not None and not self._whole:
            conn.pause()
        self._wake()

    def _finish(self, last: bytes = b"") -> None:
        """The body is whole; ``last``: its final piece (sent with the end, in push mode)."""
        self.complete = True
        self._conn = None
        sink = self._sink
        if sink is not None:
            sink(last, True)
        elif last:
            self._parts.append(last)
            self._size += len(last)
        self._wake()

    def _fail(self, exc: UpstreamError) -> None:
        self._error = exc
        self._conn = None
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def _wait(self) -> None:
        w = self._waiter = asyncio.get_running_loop().create_future()
        await w

    # -- read by the gateway --

    async def read(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The whole body; UpstreamError if the engine breaks it off or it exceeds ``limit``."""
        self._whole = True
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        while not self.complete:
            if self._error is not None:
                raise self._error
            if self._size > limit:
                self.close()
                raise UpstreamProtocolError(f"response body larger than {limit} bytes")
            await self._wait()
        if self._size > limit:
            raise UpstreamProtocolError(f"response body larger than {limit} bytes")
        parts = self._parts
        self._parts = []
        self._size = 0
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read_chunk(self) -> bytes:
        """What has arrived since the last call (waiting for something); b"" at the end."""
        while not self._parts:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        parts = self._parts
        self._parts = []
        self._size = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def stream_to(self, sink: Sink) -> None:
        """Push mode: from now on every body piece goes to ``sink(piece, last)`` as it arrives
        (what has arrived already, at once), and the end of the body as ``last=True`` with the
        final piece. ``sink`` returns False when its client cannot take more: reading from the
        engine then pauses (``held``) until :meth:`release` (see :meth:`relayed`)."""
        self._sink = sink
        parts = self._parts
        self._parts = []
        self._size = 0
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if self.complete:
            sink(data, True)
        elif data and not sink(data, False):
            self._hold()
        else:
            conn = self._conn
            if conn is not None and conn.paused:
                conn.resume()

    async def relayed(self) -> None:
        """Push mode: return once the whole body went to the sink, or when reading is
        ``held`` (drain the client, then :meth:`release`); UpstreamError if the body broke."""
        while True:
            if self._error is not None:
                raise self._error
            if self.complete or self.held:
                return
            await self._wait()

    def _hold(self) -> None:
        """Push mode: the sink's client is full; stop reading from the engine."""
        self.held = True
        conn = self._conn
        if conn is not None:
            conn.pause()

    def release(self) -> None:
        """Push mode: the client drained; read from the engine again."""
        if self.held:
            self.held = False
            conn = self._conn
            if conn is not None:
                conn.resume()

    def close(self) -> None:
        """Abandon the answer: an unfinished one closes its connection (the engine sees the
        client go away); a finished one has already given its connection back."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.abort()
        if not self.complete and self._error is None:
            self._error = UpstreamClosed("response closed by the gateway")


# ---- the connection -------------------------------------------------------------------------


class _Conn(asyncio.Protocol):
    """One keep-alive connection to one origin; at most one request on it at a time."""

    __slots__ = (
        "buf",
        "chunks",
        "framing",
        "got_bytes",
        "head_waiter",
        "keep_alive",
        "origin",
        "paused",
        "pool",
        "remaining",
        "resp",
        "scan",
        "state",
        "ticks",
        "transport",
        "uses",
    )

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.state = _IDLE
        self.head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self.resp: UpstreamResponse | None = None
        self.buf = bytearray()  # an incomplete head, growing
        self.scan = 0  # where in buf to look for the end of the head next
        self.framing = _LENGTH
        self.remaining = 0
        self.chunks: ChunkedDecoder | None = None
        self.keep_alive = True
        self.got_bytes = False
        self.paused = False
        self.ticks = 0  # sweeper ticks since the last byte (busy) or since release (idle)
        self.uses = 0

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport

    def data_received(self, data: bytes) -> None:
        self.ticks = 0
        state = self.state
        if state == _BODY:
            self._feed_body(data)
        elif state == _HEAD:
            self.got_bytes = True
            self._feed_head(data)
        elif state == _IDLE:  # nothing was asked: the connection is out of step, drop it
            self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost decides what the end means

    def connection_lost(self, exc: Exception | None) -> None:
        state = self.state
        self.state = _CLOSED
        self.pool._forget(self)
        if state == _HEAD:
            why = f": {exc!r}" if exc else ""
            self._fail_head(
                UpstreamClosed(
                    f"{self.origin} closed the connection before answering{why}",
                    before_response=not self.got_bytes,
                )
            )
        elif state == _BODY:
            resp = self.resp
            self.resp = None
            if resp is None:
                return
            if self.framing == _UNTIL_CLOSE and exc is None:
                resp._finish()
            else:
                why = f": {exc!r}" if exc else ""
                resp._fail(UpstreamClosed(f"{self.origin} closed the connection mid-body{why}"))

    # -- requests --

    def send(self, data: bytes) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None and self.state == _IDLE
        self.state = _HEAD
        self.buf = bytearray()
        self.scan = 0
        self.got_bytes = False
        self.keep_alive = True
        self.ticks = 0
        self.uses += 1
        fut: asyncio.Future[UpstreamResponse] = self.pool.loop.create_future()
        self.head_waiter = fut
        self.transport.write(data)
        return fut

    def _feed_head(self, data: bytes) -> None:
        max_head = self.pool.max_head_bytes
        if self.buf:  # a head in pieces: append, and look for its end only in the new bytes
            self.buf += data
            end = self.buf.find(b"\r\n\r\n", self.scan)
            buf: bytes = bytes(self.buf) if 0 <= end <= max_head else b""
        else:
            buf = data
            end = data.find(b"\r\n\r\n")
        if end < 0 or end > max_head:
            size = len(self.buf) or len(data)
            if size > max_head:
                self._fail(UpstreamProtocolError(f"response head larger than {max_head} bytes"))
            else:
                if not self.buf:
                    self.buf += data
                self.scan = max(0, len(self.buf) - 3)
            return
        self.buf = bytearray()
        self.scan = 0
        try:
            head = parse_head(buf[:end])
        except ValueError as exc:
            self._fail(UpstreamProtocolError(f"bad response from {self.origin}: {exc}"))
            return
        rest = buf[end + 4 :]
        if head.status < 200:
            if head.status == 101:
                self._fail(UpstreamProtocolError("unexpected 101 Switching Protocols"))
            elif rest:
                self._feed_head(rest)  # an interim answer: the real head follows
            return
        resp = UpstreamResponse(head, self)
        self.resp = resp
        self.keep_alive = head.keep_alive
        waiter = self.head_waiter
        self.head_waiter = None
        self.state = _BODY
        if head.chunked:
            self.framing = _CHUNKED
            self.chunks = ChunkedDecoder()
        elif head.length is not None:
            self.framing = _LENGTH
            self.remaining = head.length
        elif head.status in (204, 304):
            self.framing = _LENGTH
            self.remaining = 0
        else:
            self.framing = _UNTIL_CLOSE
        if waiter is not None and not waiter.done():
            waiter.set_result(resp)
        else:  # nobody waits for it any more (cancelled): drop the connection
            resp.close()
            return
        if self.framing == _LENGTH and self.remaining == 0:
            self._complete(rest)
        elif rest:
            self._feed_body(rest)

    def _feed_body(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:
            return
        framing = self.framing
        if framing == _LENGTH:
            rem = self.remaining
            n = len(data)
            if n < rem:
                self.remaining = rem - n
                resp._push(data)
            else:
                self.remaining = 0
                self._complete(data[rem:], data if n == rem else data[:rem])
        elif framing == _CHUNKED:
            dec = self.chunks
            assert dec is not None
            try:
                pieces = dec.feed(data)
            except ValueError as exc:
                self._fail(UpstreamProtocolError(f"bad chunked body from {self.origin}: {exc}"))
                return
            if dec.done:  # the last piece goes with the end (one write to the client)
                self._complete(dec.tail, pieces[0] if len(pieces) == 1 else b"".join(pieces))
                return
            for p in pieces:
                if p:
                    resp._push(p)
        else:
            resp._push(data)

    def _complete(self, tail: bytes, last: bytes = b"") -> None:
        """The answer is whole (``last``: its final piece): hand the connection back (or
        close it)."""
        resp = self.resp
        self.resp = None
        self.chunks = None
        self.state = _IDLE
        if tail:  # bytes after the end of the message: the engine is out of step
            self.keep_alive = False
        if resp is not None:
            resp._finish(last)
        if self.paused:
            self.resume()
        if self.keep_alive:
            self.pool._release(self)
        else:
            self.abort()

    def _fail_head(self, exc: UpstreamError) -> None:
        waiter = self.head_waiter
        self.head_waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def _fail(self, exc: UpstreamError) -> None:
        """Fail whatever is pending on this connection and close it."""
        self._fail_head(exc)
        resp = self.resp
        self.resp = None
        if resp is not None and not resp.complete:
            resp._fail(exc)
        self.abort()

    def timed_out(self, idle_s: float) -> None:
        self._fail(
            UpstreamTimeout(
                f"no byte from {self.origin} for {idle_s:g} s",
                before_response=self.state == _HEAD and not self.got_bytes,
            )
        )

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection at once (RST): nothing on it is wanted any more."""
        if self.state != _CLOSED:
            self.state = _CLOSED
            self.pool._forget(self)
        if self.transport is not None:
            self.transport.abort()


# ---- the pool -------------------------------------------------------------------------------


class UpstreamPool:
    """Keep-alive connections to the engines; see the module docstring."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 2.0,
        idle_timeout_s: float = 120.0,
        keepalive_s: float = 30.0,
        max_idle_per_origin: int = 1024,
        max_head_bytes: int = MAX_HEAD_BYTES,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.keepalive_s = keepalive_s
        self.max_idle_per_origin = max_idle_per_origin
        self.max_head_bytes = max_head_bytes
        self._ssl = ssl_context
        self._idle: dict[Origin, list[_Conn]] = {}
        self._conns: set[_Conn] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._targets: dict[tuple[str, str], Target] = {}
        self.opened = 0  # connections opened so far (tests and the admin view)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def target(self, base_url: str, path: str) -> Target:
        """:func:`make_target`, cached (URL parsing per request would be a visible cost)."""
        t = self._targets.get((base_url, path))
        if t is None:
            if len(self._targets) > 100_000:
                self._targets.clear()
            t = self._targets[(base_url, path)] = make_target(base_url, path)
        return t

    def connections(self) -> list[asyncio.Transport]:
        """The transports of every open connection (busy or idle)."""
        return [c.transport for c in self._conns if c.transport is not None]

    def idle_count(self, origin: Origin | None = None) -> int:
        if origin is not None:
            return len(self._idle.get(origin, ()))
        return sum(len(v) for v in self._idle.values())

    async def request(
        self, target: Target, method: bytes, headers: bytes = b"", body: bytes = b""
    ) -> UpstreamResponse:
        """Send one request and wait for the head of its answer. ``headers``: header lines,
        each ending in CRLF, without Host and Content-Length, which are added."""
        if self._closed:
            raise UpstreamConnectError("upstream pool is closed", before_response=True)
        if self._sweeper is None:
            self._start_sweeper()
        parts = [method, b" ", target.path, b" HTTP/1.1\r\nHost: ", target.host_header, b"\r\n"]
        parts.append(headers)
        if body or method not in (b"GET", b"HEAD"):
            parts += (b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        else:
            parts.append(b"\r\n")
        data = b"".join(parts)
        origin = target.origin
        for attempt in (0, 1):
            # The retry after a keep-alive race takes a new connection: the engine may have
            # closed every idle one (a restart) and the others may not have told us yet.
            conn = self._take_idle(origin) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin)
            fut = conn.send(data)
            try:
                return await fut
            except UpstreamClosed as exc:
                # The keep-alive race: the engine closed this idle connection as we sent on it.
                if reused and exc.before_response and attempt == 0:
                    continue
                raise
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    fut.result().close()
                elif conn.head_waiter is fut:
                    conn.abort()
                raise
        raise AssertionError("unreachable")

    def _take_idle(self, origin: Origin) -> _Conn | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            t = conn.transport
            if t is not None and not t.is_closing() and conn.state == _IDLE:
                return conn
            conn.abort()
        return None

    async def _connect(self, origin: Origin) -> _Conn:
        loop = self.loop
        use_ssl: ssl.SSLContext | None = None
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            use_ssl = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, conn = await loop.create_connection(
                    lambda: _Conn(self, origin),
                    origin.host,
                    origin.port,
                    ssl=use_ssl,
                    server_hostname=origin.host if use_ssl else None,
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connect to {origin} timed out after {self.connect_timeout_s:g} s",
                before_response=True,
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamConnectError(
                f"cannot connect to {origin}: {exc!r}", before_response=True
            ) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._closed:
            transport.abort()
            raise UpstreamConnectError("upstream pool is closed", before_response=True)
        self._conns.add(conn)
        self.opened += 1
        return conn

    def _release(self, conn: _Conn) -> None:
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = []
        if self._closed or len(idle) >= self.max_idle_per_origin:
            conn.abort()
            return
        conn.ticks = 0
        idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    # -- timeouts --

    def _tick_s(self) -> float:
        return max(0.01, min(1.0, self.idle_timeout_s / 4, self.keepalive_s / 4))

    def _start_sweeper(self) -> None:
        self._sweeper = self.loop.create_task(self._sweep(self._tick_s()))

    async def _sweep(self, tick: float) -> None:
        """Every ``tick``: fail busy connections silent for longer than the idle timeout, close
        idle ones unused for longer than ``keepalive_s``."""
        busy_limit = math.ceil(self.idle_timeout_s / tick)
        idle_limit = math.ceil(self.keepalive_s / tick)
        while True:
            await asyncio.sleep(tick)
            for conn in list(self._conns):
                conn.ticks += 1
                state = conn.state
                if state == _IDLE:
                    if conn.ticks > idle_limit:
                        conn.abort()
                elif not conn.paused and conn.ticks > busy_limit:
                    conn.timed_out(self.idle_timeout_s)

    async def close(self) -> None:
        """Close every connection; requests still in flight fail."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for conn in list(self._conns):
            conn._fail(UpstreamClosed("upstream pool closed"))
        self._idle.clear()
