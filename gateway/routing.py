"""Where the gateway's routing service comes from: the router embedded in-process on a broker
URL (default: the in-process memory broker), or a remote ``kvgate router`` over HTTP.

Both give a :class:`router.api.RoutingService`; the embedded one also gives broker health and lag
(for ``kvgate_gateway_broker_lag_seconds`` and degraded mode) and takes admin drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from gateway.app import DrainHook, StatsProvider
from gateway.config import StaticEngine
from router.api import RoutingService

BROKER_PING_TIMEOUT_S = 0.5
BROKER_ANSWERED_S = 1.0  # the consumer reads with a 200 ms block: a live broker answers often


@dataclass(frozen=True, slots=True)
class RoutingOptions:
    router_url: str | None = None
    broker_url: str = "memory://"
    broker_prefix: str = "kvgate:"
    policy: str = "e2"
    seed: int = 0
    static_engines: tuple[StaticEngine, ...] = ()
    router_config: Mapping[str, Any] = field(default_factory=dict)  # extra RouterConfig fields
    router: Any = None  # a whole router.core.RouterConfig (router.options), over the above


@dataclass(slots=True)
class RoutingHandle:
    service: RoutingService
    description: str
    stats: StatsProvider | None = None
    on_drain: DrainHook | None = None
    router: Any = None  # the embedded router.core.Router, for the demo's state table
    broker: Any = None


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def embedded_stats(service: Any, broker: Any) -> StatsProvider:
    """Broker health and lag (the consumer's, from ``EmbeddedRouter.state()``). The broker is
    up while the router's consumer is connected and its reads were answered within
    ``BROKER_ANSWERED_S``; only when they were not (no engine to read, or a hung connection)
    does a bounded ping decide. A ping alone timed out on a busy event loop (three vLLM engines
    beside the gateway on two cores): after ``broker_grace_s`` of that the gateway routed by
    least load while the router's view was live, and the routing benchmark lost hit rate."""

    async def stats() -> dict[str, Any]:
        lag = None
        ok = True
        answered = None
        try:
            b = service.state().get("broker") or {}
            lag = b.get("lag_s")
            # (stalled: connected, yet its reads keep failing: the view is frozen all the same)
            ok = bool(b.get("connected", True)) and not b.get("stalled", False)
            answered = b.get("answered_s_ago")
        except Exception:
            pass
        if ok and (answered is None or answered > BROKER_ANSWERED_S):
            try:
                async with asyncio.timeout(BROKER_PING_TIMEOUT_S):
                    await broker.ping()
            except Exception:
                ok = False
        return {"broker_ok": ok, "broker_lag_s": lag}

    return stats


def build_router(policy: str, seed: int, extra: Mapping[str, Any], config: Any = None) -> Any:
    """A ``router.core.Router`` from a whole ``RouterConfig`` (``config``), or with ``policy``
    and any other RouterConfig fields."""
    from router.core import Router, RouterConfig

    if config is None:
        config = RouterConfig(policy=policy, **dict(extra))
    return Router(config, random.Random(seed))


@asynccontextmanager
async def open_routing(options: RoutingOptions) -> AsyncIterator[RoutingHandle]:
    """Open the routing service the options describe; closes everything on exit."""
    if options.router_url:
        from router.client import RemoteRouter

        remote = RemoteRouter(options.router_url)
        if hasattr(remote, "start"):
            await _maybe_await(remote.start())
        try:
            yield RoutingHandle(remote, f"remote {options.router_url}")
        finally:
            if hasattr(remote, "close"):
                await _maybe_await(remote.close())
        return

    import broker as broker_mod

    broker = await broker_mod.connect(options.broker_url, prefix=options.broker_prefix)
    try:
        async with embedded_routing(
            broker,
            policy=options.policy,
            seed=options.seed,
            static_engines=options.static_engines,
            router_config=options.router_config,
            router=options.router,
            description=f"embedded {options.policy} on {options.broker_url}",
        ) as handle:
            yield handle
    finally:
        await broker.close()


@asynccontextmanager
async def embedded_routing(
    broker: Any,
    *,
    policy: str = "e2",
    seed: int = 0,
    static_engines: tuple[StaticEngine, ...] = (),
    router_config: Mapping[str, Any] | None = None,
    router: Any = None,
    description: str = "embedded",
) -> AsyncIterator[RoutingHandle]:
    """``router.core.Router`` + ``router.service.EmbeddedRouter`` on an open broker (the caller
    owns the broker: the demo shares one in-process broker with its engines)."""
    from router.service import EmbeddedRouter

    router = build_router(policy, seed, router_config or {}, router)
    for s in static_engines:
        router.add_static_engine(s.engine_id, s.url, s.models, role=s.role)
    service = EmbeddedRouter(router, broker)
    on_drain: Callable[[str, bool], None] = router.set_draining
    try:
        if hasattr(service, "start"):
            await _maybe_await(service.start())
        yield RoutingHandle(
            service,
            description,
            stats=embedded_stats(service, broker),
            on_drain=on_drain,
            router=router,
            broker=broker,
        )
    finally:
        if hasattr(service, "close"):
            with contextlib.suppress(Exception):
                await _maybe_await(service.close())
