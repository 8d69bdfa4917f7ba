"""``kvgate router``: the stateful router service (consumes the broker, serves ``POST /route``,
``GET /state`` and Prometheus ``/metrics``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal

from aiohttp import web

from kvgate.cli_support import ListenError, broker_url, listening, port, usage_error
from kvgate.logs import setup_logging
from kvgate.runtime import tune_gc
from router.core import Router
from router.options import add_router_options, router_config
from router.policies.registry import PolicyError

log = logging.getLogger("kvgate.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker", type=broker_url, default="redis://127.0.0.1:6379/0", help="broker URL"
    )
    parser.add_argument(
        "--broker-prefix", "--prefix", dest="prefix", default="kvgate:", help="broker key prefix"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port, default=8400, help="port to listen on (0: any)")
    add_router_options(parser.add_argument_group("routing (the same flags as kvgate gateway's)"))
    parser.add_argument(
        "--static-engine",
        action="append",
        default=[],
        metavar="ID=URL[,MODEL...]",
        help="an engine configured by hand (repeatable)",
    )
    parser.add_argument("--log-level", default="info")


def build(args: argparse.Namespace) -> Router:
    """The Router the arguments describe (raises PolicyError/ValueError on bad ones)."""
    router = Router(router_config(args), random.Random(args.seed))
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
    try:
        with listening(args.host, args.port):
            await site.start()
    except ListenError:
        await runner.cleanup()
        await broker.close()
        raise
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
        return usage_error("kvgate router", str(exc))
    tune_gc()  # rarer collector pauses in the decision path (kvgate.runtime)
    try:
        asyncio.run(serve(args, router))
    except KeyboardInterrupt:
        pass
    except ListenError as exc:
        return usage_error("kvgate router", str(exc))
    return 0
