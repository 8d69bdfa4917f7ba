"""A loopback TCP server that speaks HTTP/1.1 only as far as a test script says: it reads each
request (head and Content-Length body) and answers with whatever bytes, pauses, closes or
resets the script gives. For testing the gateway's own client and server against misbehaving
peers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is an optional extra
    uvloop = None

# the event loops the gateway's own protocols are tested on (uvloop is what it runs on)
LOOPS = [
    pytest.param(asyncio.new_event_loop, id="asyncio"),
    pytest.param(
        uvloop.new_event_loop if uvloop else None,
        id="uvloop",
        marks=pytest.mark.skipif(uvloop is None, reason="uvloop not installed"),
    ),
]


@dataclass
class Seen:
    """What the server saw: connections accepted, requests per connection (head, body)."""

    connections: int = 0
    requests: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (conn, head, body)
    closed_by_peer: int = 0  # connections the client closed (EOF/reset) while we waited
    writers: list[asyncio.StreamWriter] = field(default_factory=list)


Script = Callable[[int, int, bytes, bytes, asyncio.StreamWriter], Awaitable[str | None]]
"""(connection number, request number on it, head, body, writer) -> None to keep serving the
connection, "close" to close it, "reset" to reset it (RST)."""


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return head, body


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0) instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@asynccontextmanager
async def raw_server(script: Script) -> AsyncIterator[tuple[str, Seen]]:
    """Run ``script`` for every request on a free loopback port; yields (base URL, Seen)."""
    seen = Seen()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        seen.writers.append(writer)
        conn = seen.connections
        n = 0
        try:
            while True:
                try:
                    head, body = await read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    seen.closed_by_peer += 1
                    return
                n += 1
                seen.requests.append((conn, head, body))
                action = await script(conn, n, head, body, writer)
                await writer.drain()
                if action == "reset":
                    reset(writer)
                    return
                if action == "close":
                    return
        except ConnectionError:
            seen.closed_by_peer += 1
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        for w in seen.writers:
            w.transport.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


def ok_response(body: bytes = b'{"ok": true}', extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
