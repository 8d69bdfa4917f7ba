"""``kvgate gateway``: the OpenAI-compatible reverse proxy.

kvgate gateway --port 8000                                  # embedded router, memory broker
kvgate gateway --broker-url redis://127.0.0.1:6379/0 --policy e2
kvgate gateway --router-url http://router:9000              # a remote ``kvgate router``
kvgate gateway --engine e0=http://10.0.0.5:8000,llama-3-8b  # static engines (repeatable)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from gateway.app import create_app, serve
from gateway.config import BreakerConfig, GatewayConfig, parse_engine_spec, parse_template_spec
from gateway.routing import RoutingOptions, open_routing
from kvgate.logs import setup_logging
from kvgate.openai_request import ChatTemplate
from kvgate.slo import DEFAULT_SLO_CLASS, SLO_CLASSES

log = logging.getLogger("kvgate.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    parser.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="port (default %(default)s)")
    r = parser.add_argument_group("routing")
    r.add_argument(
        "--router-url",
        help="use a remote `kvgate router` at this URL instead of the embedded router",
    )
    r.add_argument(
        "--broker",
        "--broker-url",
        dest="broker_url",
        default=os.environ.get("KVGATE_BROKER_URL", "memory://"),
        help="embedded router's broker: memory://, redis://, rediss://, redis+sentinel:// "
        "(env KVGATE_BROKER_URL; default %(default)s)",
    )
    r.add_argument("--broker-prefix", default="kvgate:", help="broker key prefix (%(default)s)")
    r.add_argument("--policy", default="e2", help="embedded router's policy (default %(default)s)")
    r.add_argument("--seed", type=int, default=0, help="embedded router's random seed")
    r.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="ID=URL[,MODEL...]",
        help="a static engine (repeatable); models are discovered from /v1/models if omitted",
    )
    r.add_argument(
        "--chat-template",
        action="append",
        default=[],
        metavar="[MODEL=]PATH",
        help="chat template (model dir or .jinja) for the routing key; repeat per model",
    )
    r.add_argument(
        "--default-slo-class",
        default=DEFAULT_SLO_CLASS,
        choices=sorted(SLO_CLASSES),
        help="SLO of requests that state none (default %(default)s)",
    )
    p = parser.add_argument_group("proxy")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s, metavar="S")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        metavar="S",
        help="give up on an upstream that sends no byte for this long (default %(default)s)",
    )
    p.add_argument("--route-timeout", type=float, default=d.route_timeout_s, metavar="S")
    p.add_argument("--max-retries", type=int, default=d.max_retries)
    p.add_argument("--health-interval", type=float, default=d.health_interval_s, metavar="S")
    p.add_argument(
        "--eject-after",
        type=int,
        default=BreakerConfig().failures,
        metavar="N",
        help="consecutive failures that eject an engine (default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout_s,
        metavar="S",
        help="on SIGTERM, how long open streams may finish (default %(default)s)",
    )
    p.add_argument(
        "--debug-route",
        action="store_true",
        help="always add the x-kvgate-route header (else only when x-kvgate-debug: 1 is sent)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("KVGATE_ADMIN_TOKEN"),
        help="bearer token for /admin (env KVGATE_ADMIN_TOKEN); admin is off without one",
    )
    o = parser.add_argument_group("logging")
    o.add_argument("--log-level", default="info")
    o.add_argument("--no-access-log", action="store_true", help="no JSON line per request")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The frozen config; ValueError names the bad option."""
    return GatewayConfig(
        host=args.host,
        port=args.port,
        max_body_bytes=args.max_body_bytes,
        connect_timeout_s=args.connect_timeout,
        idle_timeout_s=args.idle_timeout,
        route_timeout_s=args.route_timeout,
        max_retries=max(0, args.max_retries),
        health_interval_s=args.health_interval,
        drain_timeout_s=args.drain_timeout,
        debug_header=args.debug_route,
        admin_token=args.admin_token or None,
        access_log=not args.no_access_log,
        static_engines=tuple(parse_engine_spec(s) for s in args.engine),
        breaker=BreakerConfig(failures=max(1, args.eject_after)),
    )


def load_templates(specs: list[str]) -> dict[str | None, ChatTemplate]:
    out: dict[str | None, ChatTemplate] = {}
    for spec in specs:
        model, path = parse_template_spec(spec)
        out[model] = ChatTemplate.from_path(path)
    return out


async def serve_forever(args: argparse.Namespace, config: GatewayConfig) -> int:
    templates = load_templates(args.chat_template)
    options = RoutingOptions(
        router_url=args.router_url,
        broker_url=args.broker_url,
        broker_prefix=args.broker_prefix,
        policy=args.policy,
        seed=args.seed,
        static_engines=config.static_engines,
    )
    async with open_routing(options) as routing:
        app = create_app(
            config,
            routing.service,
            templates=templates,
            default_slo=SLO_CLASSES[args.default_slo_class],
            stats=routing.stats,
            on_drain=routing.on_drain,
        )
        runner, port = await serve(
            app, config.host, config.port, drain_timeout_s=config.drain_timeout_s
        )
        log.info(
            "gateway listening",
            extra={"url": f"http://{config.host}:{port}", "router": routing.description},
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            log.info("stopping: draining open streams for up to %.0f s", config.drain_timeout_s)
            await runner.cleanup()
    return 0


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        return runner.run(serve_forever(args, config))
