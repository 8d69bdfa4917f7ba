"""The Redis Streams broker: the only module in kvgate that imports redis.

URL forms (:func:`connect_redis`):

* ``redis://[[user]:password@]host[:port][/db]`` and ``rediss://...`` (TLS; redis-py query
  options such as ``?ssl_cert_reqs=none`` or ``?ssl_ca_certs=/path`` apply);
* ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db]``, and
  ``rediss+sentinel://`` for TLS; the password is the master's, ``?sentinel_password=`` the
  sentinels'. The master is looked up again on every reconnect, so a failover is an outage
  of a few seconds that the reporter and consumer ride out like any other.

Every operation maps redis' connection, timeout, loading and read-only (failover) errors to
:class:`broker.base.BrokerUnavailable`, so callers need not know redis' exception tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from urllib.parse import parse_qs, unquote

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from broker.base import (
    START_ID,
    BadPosition,
    BadStream,
    BrokerError,
    BrokerStats,
    BrokerUnavailable,
    Fields,
    ReadResult,
    refused_positions,
)
from broker.events import MAX_TEXT_CHARS

# Blocking reads must end well before the socket timeout, or a quiet stream looks like a dead
# server.
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 3.0
MAX_BLOCK_MS = 5000
CLOSE_TIMEOUT_S = 5.0
RETENTION_S = 24 * 3600  # an engine's stream and snapshot outlive its last registration this long
_UNAVAILABLE = (
    rexc.ConnectionError,  # includes BusyLoadingError and sentinel's MasterNotFoundError
    rexc.TimeoutError,
    rexc.ReadOnlyError,  # we reached a replica: a failover is under way
    TimeoutError,
    OSError,
)

log = logging.getLogger("kvgate.broker")


@contextlib.contextmanager
def _mapped_errors(stats: BrokerStats) -> Iterator[None]:
    try:
        yield
    except _UNAVAILABLE as exc:
        stats.errors += 1
        raise BrokerUnavailable(f"redis unavailable: {type(exc).__name__}: {exc}") from exc
    except rexc.RedisError as exc:
        stats.errors += 1
        raise BrokerError(f"redis error: {type(exc).__name__}: {exc}") from exc


def _common_kwargs() -> dict:
    return {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        # One quick retry heals a pooled connection that a server restart left dead; longer
        # outages are the caller's to ride out (reporter drops and resyncs, consumer backs off).
        "retry": Retry(NoBackoff(), 1),
        "retry_on_error": [rexc.ConnectionError, rexc.TimeoutError],
        "health_check_interval": 30,
    }


def parse_sentinel_url(url: str) -> dict:
    """Split a ``redis+sentinel://`` URL into sentinels, service, db, passwords and TLS flag."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis+sentinel", "rediss+sentinel"):
        raise ValueError(f"not a sentinel URL: {url!r}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        hosts, userinfo = netloc, ""
    username, _, password = userinfo.partition(":") if ":" in userinfo else ("", "", userinfo)
    sentinels = []
    for part in hosts.split(","):
        host, colon, port = part.rpartition(":")
        if not colon:
            host, port = part, "26379"
        host = host.strip("[]")
        if not host:
            raise ValueError(f"sentinel URL has an empty host: {url!r}")
        sentinels.append((host, int(port)))
    segments = [s for s in path.split("/") if s]
    if not segments:
        raise ValueError(f"sentinel URL needs a service name: {url!r}")
    if len(segments) > 2:
        raise ValueError(f"sentinel URL path must be /service_name[/db]: {url!r}")
    params = {k: v[-1] for k, v in parse_qs(query).items()}
    return {
        "sentinels": sentinels,
        "service": unquote(segments[0]),
        "db": int(segments[1]) if len(segments) == 2 else 0,
        "username": unquote(username) or None,
        "password": unquote(password) or None,
        "sentinel_password": params.get("sentinel_password"),
        "ssl": scheme == "rediss+sentinel",
    }


class RedisBroker:
    """Broker on Redis Streams: pipelined ``XADD MAXLEN ~``, multi-stream ``XREAD``."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = "kvgate:", sentinel=None):
        self.prefix = prefix
        self.stats = BrokerStats()
        self._redis = client
        self._sentinel = sentinel
        self._stream_prefix = f"{prefix}s:".encode()
        self._registry_key = f"{prefix}engines".encode()

    def _key(self, kind: str, engine_id: str) -> bytes:
        return f"{self.prefix}{kind}:{engine_id}".encode()

    def _stream(self, engine_id: str) -> bytes:
        return self._stream_prefix + engine_id.encode()

    async def append(
        self, engine_id: str, entries: Sequence[Fields], *, maxlen: int | None = None
    ) -> list[str]:
        if not entries:
            return []
        key = self._stream(engine_id)
        maxlen = maxlen if maxlen and maxlen > 0 else None  # 0 or None: never trim
        with _mapped_errors(self.stats):
            async with self._redis.pipeline(transaction=False) as pipe:
                for fields in entries:
                    pipe.xadd(key, fields, maxlen=maxlen, approximate=True)
                ids = await pipe.execute()
        self.stats.appended_entries += len(ids)
        self.stats.appended_bytes += sum(len(v) for f in entries for v in f.values())
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    async def read(
        self, positions: Mapping[str, str], *, count: int = 1000, block_ms: int | None = None
    ) -> ReadResult:
        if not positions:
            return []
        streams = {self._stream(e): pos for e, pos in positions.items()}
        block = min(int(block_ms), MAX_BLOCK_MS) if block_ms and block_ms > 0 else None
        self.stats.read_calls += 1
        try:
            with _mapped_errors(self.stats):
                reply = await self._redis.xread(streams, count=count, block=block)
        except BrokerError as exc:
            if isinstance(exc, BrokerUnavailable):
                raise
            if "WRONGTYPE" in str(exc):
                raise BadStream(await self._non_streams(positions)) from exc
            # One stream's position can fail the whole multi-stream read ("Invalid stream
            # ID"): name the streams at fault so that the others are read without them.
            bad = refused_positions(positions)
            if bad:
                raise BadPosition(bad) from exc
            raise
        skip = len(self._stream_prefix)
        out: ReadResult = []
        for key, entries in reply or ():
            engine_id = key[skip:].decode()
            out.append((engine_id, [(i.decode(), f) for i, f in entries]))
            self.stats.read_entries += len(entries)
        return out

    async def _non_streams(self, engine_ids: Sequence[str]) -> list[str]:
        with _mapped_errors(self.stats):
            async with self._redis.pipeline(transaction=False) as pipe:
                for e in engine_ids:
                    pipe.type(self._stream(e))
                types = await pipe.execute()
        return [e for e, t in zip(engine_ids, types, strict=True) if t not in (b"stream", b"none")]

    async def last_id(self, engine_id: str) -> str:
        with _mapped_errors(self.stats):
            reply = await self._redis.xrevrange(self._stream(engine_id), count=1)
        return reply[0][0].decode() if reply else START_ID

    async def register(self, engine_id: str, ttl_s: float) -> bool:
        with _mapped_errors(self.stats):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(self._key("alive", engine_id), b"1", px=max(1, int(ttl_s * 1000)))
                pipe.sadd(self._registry_key, engine_id.encode())
                pipe.getdel(self._key("snapreq", engine_id))
                pipe.exists(self._key("snap", engine_id))
                # A live engine keeps its stream and snapshot; a gone one's vanish after a while.
                keep_ms = max(int(ttl_s * 1000), int(RETENTION_S * 1000))
                pipe.pexpire(self._stream(engine_id), keep_ms)
                pipe.pexpire(self._key("snap", engine_id), keep_ms)
                _, _, requested, has_snapshot, _, _ = await pipe.execute()
        return requested is not None or not has_snapshot

    async def unregister(self, engine_id: str) -> None:
        with _mapped_errors(self.stats):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.delete(self._key("alive", engine_id))
                pipe.srem(self._registry_key, engine_id.encode())
                await pipe.execute()

    async def engines(self) -> list[str]:
        with _mapped_errors(self.stats):
            members = sorted(await self._redis.smembers(self._registry_key))
            ids: list[str] = []
            bad: list[bytes] = []
            for m in members:
                engine_id = _engine_id(m)
                if engine_id is None:
                    bad.append(m)
                else:
                    ids.append(engine_id)
            if bad:
                # not an engine's (no reporter writes it): dropped, or it would stop discovery
                self.stats.bad_registry_members += len(bad)
                log.warning("broker: dropping registry members that are no engine id: %r", bad[:3])
                await self._redis.srem(self._registry_key, *bad)
            if not ids:
                return []
            async with self._redis.pipeline(transaction=False) as pipe:
                for engine_id in ids:
                    pipe.exists(self._key("alive", engine_id))
                alive = await pipe.execute()
            dead = [i for i, a in zip(ids, alive, strict=True) if not a]
            if dead:
                # Bounded registry: an engine that comes back re-adds itself on its next refresh.
                await self._redis.srem(self._registry_key, *dead)
        return [i for i, a in zip(ids, alive, strict=True) if a]

    async def put_snapshot(self, engine_id: str, data: bytes) -> None:
        with _mapped_errors(self.stats):
            await self._redis.set(self._key("snap", engine_id), data)

    async def get_snapshot(self, engine_id: str) -> bytes | None:
        with _mapped_errors(self.stats):
            return await self._redis.get(self._key("snap", engine_id))

    async def request_snapshot(self, engine_id: str) -> None:
        with _mapped_errors(self.stats):
            await self._redis.set(self._key("snapreq", engine_id), b"1", ex=60)

    async def ping(self) -> None:
        with _mapped_errors(self.stats):
            await self._redis.ping()

    async def close(self) -> None:
        """Close the connections; bounded (``CLOSE_TIMEOUT_S`` each) even while Redis is down."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self._redis.aclose()
        if self._sentinel is not None:
            for conn in self._sentinel.sentinels:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(CLOSE_TIMEOUT_S):
                        await conn.aclose()


def connect_redis(url: str, *, prefix: str = "kvgate:") -> RedisBroker:
    """A broker for a ``redis://``, ``rediss://`` or ``redis+sentinel://`` URL. Connections open
    lazily: an unreachable server shows up as BrokerUnavailable on use, not here."""
    if url.startswith(("redis+sentinel://", "rediss+sentinel://")):
        cfg = parse_sentinel_url(url)
        kwargs = _common_kwargs()
        tls = {"ssl": True} if cfg["ssl"] else {}
        sentinel_kwargs = {
            "socket_timeout": CONNECT_TIMEOUT_S,
            "socket_connect_timeout": CONNECT_TIMEOUT_S,
            **tls,
        }
        if cfg["sentinel_password"]:
            sentinel_kwargs["password"] = cfg["sentinel_password"]
        sentinel = Sentinel(cfg["sentinels"], sentinel_kwargs=sentinel_kwargs, **tls)
        client = sentinel.master_for(
            cfg["service"],
            db=cfg["db"],
            username=cfg["username"],
            password=cfg["password"],
            **kwargs,
        )
        return RedisBroker(client, prefix=prefix, sentinel=sentinel)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisBroker(aioredis.Redis.from_url(url, **_common_kwargs()), prefix=prefix)
    raise ValueError(f"unsupported Redis URL scheme: {url!r}")


def _engine_id(member: bytes) -> str | None:
    """A registry member as an engine id (what :class:`broker.events.Envelope` accepts: UTF-8,
    1 to ``MAX_TEXT_CHARS`` characters), or None."""
    try:
        text = member.decode()
    except UnicodeDecodeError:
        return None
    return text if 0 < len(text) <= MAX_TEXT_CHARS else None
