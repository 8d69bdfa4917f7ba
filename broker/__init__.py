"""The event path between engines and routers: schema, codec, transports, consumer.

``await broker.connect(url)`` gives a :class:`~broker.base.Broker`: ``memory://`` a new embedded
in-process broker, ``redis://``, ``rediss://`` or ``redis+sentinel://`` one on Redis Streams
(see :mod:`broker.redis_broker` for the URL forms). Engines publish through
``engine_reporter.Reporter``; routers read through :class:`broker.consumer.Consumer`.
"""

from __future__ import annotations

from broker.base import Broker, BrokerError, BrokerUnavailable
from broker.memory import MemoryBroker
from broker.urls import check_broker_url

__all__ = ["Broker", "BrokerError", "BrokerUnavailable", "MemoryBroker", "connect"]


async def connect(url: str, *, prefix: str = "kvgate:") -> Broker:
    """Open a broker for ``url``. Redis connections open lazily (an engine must start even while
    Redis is down), so a bad URL fails here but an unreachable server fails on first use."""
    check_broker_url(url)
    if url == "memory://" or url.startswith("memory:"):
        return MemoryBroker(prefix=prefix)
    # Imported here so that importing ``broker`` (e.g. for its pure schema) never loads redis.
    from broker.redis_broker import connect_redis

    return connect_redis(url, prefix=prefix)
