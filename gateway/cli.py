"""``kvgate gateway``: the OpenAI-compatible reverse proxy.

kvgate gateway --port 8000                                  # embedded router, memory broker
kvgate gateway --broker-url redis://127.0.0.1:6379/0 --policy e2
kvgate gateway --router-url http://router:9000              # a remote ``kvgate router``
kvgate gateway --engine e0=http://10.0.0.5:8000,llama-3-8b  # static engines (repeatable)
kvgate gateway --workers 0 --broker-url redis://127.0.0.1:6379/0  # one process per CPU
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal

from gateway.app import create_app, metrics_app, serve
from gateway.config import BreakerConfig, GatewayConfig, parse_engine_spec, parse_template_spec
from gateway.routing import RoutingOptions, open_routing
from gateway.workers import RestartPolicy, Supervisor, multi_worker_error, resolve_workers
from kvgate.cli_support import (
    ListenError,
    broker_url,
    http_url,
    listening,
    load_chat_template,
    port,
    usage_error,
)
from kvgate.logs import setup_logging
from kvgate.openai_request import ChatTemplate
from kvgate.runtime import tune_gc
from kvgate.slo import DEFAULT_SLO_CLASS, SLO_CLASSES
from kvgate.slo_forward import FORWARD_MODES
from router.options import add_router_options, router_config
from router.policies.registry import PolicyError

log = logging.getLogger("kvgate.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    parser.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=port, default=d.port, help="port (default %(default)s)")
    w = parser.add_argument_group("processes")
    w.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="gateway processes sharing the port (SO_REUSEPORT); 0 = one per CPU. N > 1 needs "
        "a shared broker (redis://) or --router-url (default %(default)s)",
    )
    w.add_argument(
        "--metrics-port-base",
        type=port,
        default=None,
        metavar="PORT",
        help="worker i also serves /metrics on PORT+i, so Prometheus can scrape every worker "
        "(the shared port answers from one worker per scrape)",
    )
    w.add_argument(
        "--worker-restart-limit",
        type=int,
        default=RestartPolicy().max_fast_failures,
        metavar="K",
        help=f"give up after K consecutive worker deaths within "
        f"{RestartPolicy().fast_failure_s:.0f} s of their start (default %(default)s)",
    )
    r = parser.add_argument_group("routing")
    r.add_argument(
        "--router-url",
        type=http_url,
        help="use a remote `kvgate router` at this URL instead of the embedded router",
    )
    r.add_argument(
        "--broker",
        "--broker-url",
        dest="broker_url",
        type=broker_url,
        default=os.environ.get("KVGATE_BROKER_URL", "memory://"),
        help="embedded router's broker: memory://, redis://, rediss://, redis+sentinel:// "
        "(env KVGATE_BROKER_URL; default %(default)s)",
    )
    r.add_argument("--broker-prefix", default="kvgate:", help="broker key prefix (%(default)s)")
    r.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="ID=URL[,MODEL...][,role=ROLE]",
        help="a static engine (repeatable); models are discovered from /v1/models if omitted; "
        "role=prefill|decode|both for a disaggregated fleet (default both)",
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
    add_router_options(
        parser.add_argument_group("embedded router (the same flags as kvgate router's)")
    )
    p = parser.add_argument_group("proxy")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument(
        "--head-timeout",
        type=float,
        default=d.head_timeout_s,
        metavar="S",
        help="a request's whole head must arrive within this of its first byte, else 408 "
        "(default %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        metavar="S",
        help="a request's whole body must arrive within this of its head, else 408 "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        metavar="N",
        help="open client connections per worker; more are answered 503 and closed "
        "(default %(default)s)",
    )
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s, metavar="S")
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        metavar="S",
        help="give up on an upstream that sends no byte for this long (default %(default)s)",
    )
    p.add_argument("--route-timeout", type=float, default=d.route_timeout_s, metavar="S")
    p.add_argument(
        "--forward-slo",
        choices=FORWARD_MODES,
        default=d.forward_slo,
        help="vllm: pass each request's SLO to vLLM engines running kvgate's scheduler "
        "(vllm_xargs); vllm-priority: also set vLLM's priority from the TTFT SLO (engines run "
        "with --scheduling-policy priority); default %(default)s (the body as sent)",
    )
    p.add_argument(
        "--broker-grace",
        type=float,
        default=d.broker_grace_s,
        metavar="S",
        help="route by least load only after the router's broker has failed this long "
        "(default %(default)s)",
    )
    p.add_argument(
        "--ready-wait",
        type=float,
        default=d.ready_wait_s,
        metavar="S",
        help="before the gateway is ready (its router caught up with the broker, an engine "
        "known), a request waits this long for it, then gets 503 (default %(default)s)",
    )
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
        "--busy-poll",
        action="store_true",
        help="poll sockets without sleeping while requests are open: cuts the wake-ups that "
        "dominate added latency on VMs, at the cost of a busy core per worker while any "
        "request is open (see docs/gateway.md)",
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
        head_timeout_s=args.head_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        connect_timeout_s=args.connect_timeout,
        idle_timeout_s=args.idle_timeout,
        route_timeout_s=args.route_timeout,
        forward_slo=args.forward_slo,
        broker_grace_s=args.broker_grace,
        max_retries=max(0, args.max_retries),
        health_interval_s=args.health_interval,
        drain_timeout_s=args.drain_timeout,
        ready_wait_s=args.ready_wait,
        debug_header=args.debug_route,
        busy_poll=args.busy_poll,
        admin_token=args.admin_token or None,
        access_log=not args.no_access_log,
        static_engines=tuple(parse_engine_spec(s) for s in args.engine),
        breaker=BreakerConfig(failures=max(1, args.eject_after)),
    )


def load_templates(specs: list[str]) -> dict[str | None, ChatTemplate]:
    """The ``--chat-template [MODEL=]PATH`` templates by model; ValueError naming a bad one."""
    out: dict[str | None, ChatTemplate] = {}
    for spec in specs:
        model, path = parse_template_spec(spec)
        out[model] = load_chat_template(path)
    return out


async def serve_forever(
    args: argparse.Namespace, config: GatewayConfig, *, slot: int = 0, reuse_port: bool = False
) -> int:
    """One gateway process: the whole gateway when alone, or worker ``slot`` of several."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # first: a stop during startup is not a crash
        loop.add_signal_handler(sig, stop.set)
    templates = load_templates(args.chat_template)
    options = RoutingOptions(
        router_url=args.router_url,
        broker_url=args.broker_url,
        broker_prefix=args.broker_prefix,
        policy=args.policy,
        seed=args.seed,
        static_engines=config.static_engines,
        router=router_config(args),
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
        if stop.is_set():
            return 0
        with listening(config.host, config.port):
            runner, bound = await serve(
                app,
                config.host,
                config.port,
                drain_timeout_s=config.drain_timeout_s,
                reuse_port=reuse_port,
            )
        metrics_runner = None
        try:
            if args.metrics_port_base is not None:
                metrics_port = args.metrics_port_base + slot
                with listening(config.host, metrics_port):
                    metrics_runner, _ = await serve(metrics_app(app), config.host, metrics_port)
            log.info(
                "gateway listening",
                extra={
                    "url": f"http://{config.host}:{bound}",
                    "router": routing.description,
                    "worker": slot,
                    "pid": os.getpid(),
                },
            )
            await stop.wait()
        finally:
            log.info("stopping: draining open streams for up to %.0f s", config.drain_timeout_s)
            if metrics_runner is not None:
                await metrics_runner.cleanup()
            await runner.cleanup()
    return 0


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
        workers = resolve_workers(args.workers)
        router_config(args)  # (a bad policy or option fails here, before anything starts)
        load_templates(args.chat_template)  # (and a missing template)
    except (PolicyError, ValueError, TypeError) as exc:
        log.error("%s", exc)
        return usage_error("kvgate gateway", str(exc))
    problem = multi_worker_error(workers, args.router_url, args.broker_url)
    if problem is not None:
        log.error("%s", problem)
        return usage_error("kvgate gateway", problem)
    try:
        if workers == 1:
            return run_worker(args, 0, config.port, reuse_port=False)
        supervisor = Supervisor(
            args,
            workers,
            run_worker,
            policy=RestartPolicy(max_fast_failures=max(1, args.worker_restart_limit)),
            drain_timeout_s=config.drain_timeout_s,
        )
        return supervisor.run(config.host, config.port)
    except ListenError as exc:
        log.error("%s", exc)
        return usage_error("kvgate gateway", str(exc))


def run_worker(args: argparse.Namespace, slot: int, port: int, *, reuse_port: bool = True) -> int:
    """One gateway process on its own event loop (uvloop when installed)."""
    config = dataclasses.replace(config_from_args(args), port=port)
    tune_gc()  # the embedded router's decisions: rarer collector pauses (kvgate.runtime)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        return runner.run(serve_forever(args, config, slot=slot, reuse_port=reuse_port))
