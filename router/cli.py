"""``kvgate router``: the stateful router service (consumes the broker, serves ``POST /route``,
``GET /state`` and Prometheus ``/metrics``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal

from aiohttp import web

from kvgate.logs import setup_logging
from kvgate.runtime import tune_gc
from router.cluster import ClusterConfig
from router.core import Router, RouterConfig
from router.policies.registry import POLICIES, PolicyError, make_policy

log = logging.getLogger("kvgate.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0", help="broker URL")
    parser.add_argument(
        "--broker-prefix", "--prefix", dest="prefix", default="kvgate:", help="broker key prefix"
    )
    parser.add_argument("--policy", default="e2", choices=sorted(POLICIES), help="routing policy")
    parser.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a field of the policy's config, e.g. rebalance=false (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8400, help="port to listen on (0: any)")
    parser.add_argument("--tree-budget-mb", type=float, default=1024.0, help="radix tree budget")
    parser.add_argument("--window-s", type=float, default=180.0, help="load/prefix window")
    parser.add_argument("--heartbeat-ttl-s", type=float, default=15.0, help="engine liveness TTL")
    parser.add_argument(
        "--inflight-timeout-s", type=float, default=600.0, help="forget unreported requests after"
    )
    parser.add_argument(
        "--speculative-ttl-s", type=float, default=10.0, help="routed key assumed cached for"
    )
    parser.add_argument(
        "--speculative-grace-s",
        type=float,
        default=1.0,
        help="... and, on an engine reporting KV events, this long after its request ended",
    )
    parser.add_argument(
        "--approximate",
        action="store_true",
        help="build the cache map from routing decisions only (engines without reporters)",
    )
    parser.add_argument(
        "--static-engine",
        action="append",
        default=[],
        metavar="ID=URL[,MODEL...]",
        help="an engine configured by hand (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the policy's rng")
    parser.add_argument("--log-level", default="info")


def _options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise PolicyError(f"--policy-option wants NAME=VALUE, got {pair!r}")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def build(args: argparse.Namespace) -> Router:
    """The Router the arguments describe (raises PolicyError/ValueError on bad ones)."""
    options = _options(args.policy_option)
    make_policy(args.policy, options)  # validate before anything starts
    cluster = ClusterConfig(
        window_s=args.window_s,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        inflight_timeout_s=args.inflight_timeout_s,
        tree_budget_bytes=int(args.tree_budget_mb * (1 << 20)),
        speculative_ttl_s=args.speculative_ttl_s,
        speculative_grace_s=args.speculative_grace_s,
        approximate=args.approximate,
    )
    router = Router(RouterConfig(args.policy, options, cluster), random.Random(args.seed))
    for spec in args.static_engine:
        engine_id, sep, rest = spec.partition("=")
        if not sep or not engine_id or not rest:
            raise ValueError(f"--static-engine wants ID=URL[,MODEL...], got {spec!r}")
        url, *models = rest.split(",")
        router.add_static_engine(engine_id, url, models)
    return router


async def serve(args: argparse.Namespace, router: Router) -> None:
    import broker as broker_mod
    from router.service import EmbeddedRouter, create_app

    broker = await broker_mod.connect(args.broker, prefix=args.prefix)
    service = EmbeddedRouter(router, broker)
    runner = web.AppRunner(create_app(service), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info(
        "router listening",
        extra={"host": args.host, "port": args.port, "policy": args.policy, "broker": args.broker},
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # Kubernetes sends SIGTERM: shut down cleanly
    try:
        await stop.wait()
        log.info("router stopping")
    finally:
        await runner.cleanup()
        await broker.close()


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        router = build(args)
    except (PolicyError, ValueError, TypeError) as exc:
        log.error("bad arguments: %s", exc)
        return 2
    tune_gc()  # rarer collector pauses in the decision path (kvgate.runtime)
    try:
        asyncio.run(serve(args, router))
    except KeyboardInterrupt:
        pass
    return 0
