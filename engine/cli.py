"""``kvgate engine``: run a simulated engine, or fit a cost profile from measurements.

kvgate engine --port 8001 --engine-id e1 --policy slo --broker redis://127.0.0.1:6379
kvgate engine fit-profile timings.jsonl --name my-gpu --out kvgate/profiles/my-gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

import orjson

from engine.scheduler import POLICIES
from engine.scheduler.state import SchedulerConfig
from kvgate.cli_support import (
    ListenError,
    broker_url,
    listening,
    load_chat_template,
    port,
    usage_error,
)
from kvgate.cost_model import DEFAULT_PROFILE, ProfileError, load_profile
from kvgate.logs import setup_logging
from kvgate.slo import DEFAULT_SLO_CLASS, SLO_CLASSES

log = logging.getLogger("kvgate.engine")
_DEFAULTS = SchedulerConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=port, default=8001, help="port to bind (0: any free)")
    parser.add_argument("--engine-id", default="engine-0", help="id in events and metrics")
    parser.add_argument("--model", default="kvgate-sim", help="served model name")
    parser.add_argument("--alias", action="append", default=[], help="another accepted name")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="cost profile name or path")
    parser.add_argument("--policy", default="slo", choices=sorted(POLICIES))
    parser.add_argument(
        "--broker", type=broker_url, default=None, help="publish events (redis://, memory://)"
    )
    parser.add_argument("--broker-prefix", default="kvgate:", help="broker key prefix")
    parser.add_argument("--url-advertised", default="", help="base URL routers should use")
    parser.add_argument(
        "--default-slo",
        default=DEFAULT_SLO_CLASS,
        choices=sorted(SLO_CLASSES),
        help="SLO class of requests that state none",
    )
    parser.add_argument("--default-max-tokens", type=int, default=128)
    parser.add_argument("--chat-template", default=None, help="model folder or .jinja file")
    parser.add_argument("--token-budget", type=int, default=_DEFAULTS.token_budget)
    parser.add_argument("--chunk-tokens", type=int, default=_DEFAULTS.chunk_tokens)
    parser.add_argument(
        "--keep-infeasible",
        action="store_true",
        help="slo policy: keep requests whose TTFT can no longer be met (waiting ones queue "
        "last, paused prefills resume when nothing feasible waits) instead of rejecting them",
    )
    parser.add_argument("--reject-status", type=int, choices=(429, 503), default=429)
    parser.add_argument("--heartbeat-s", type=float, default=0.2)
    parser.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="part in a prefill/decode disaggregated fleet (docs/router.md); default: both",
    )
    parser.add_argument(
        "--kv-link-gbps",
        type=float,
        default=100.0,
        help="simulated link a decode engine pulls a prompt's KV over (Gb/s)",
    )
    parser.add_argument(
        "--kv-bytes-per-token", type=int, default=131_072, help="simulated KV size per token"
    )
    parser.add_argument("--log-level", default="info")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    fit = sub.add_parser("fit-profile", help="fit a cost profile JSON from measured timings")
    fit.add_argument("input", help="JSONL of prefill and decode measurements (see docs)")
    fit.add_argument("--name", required=True, help="profile name")
    fit.add_argument("--out", default="-", help="output path ('-': stdout)")
    fit.add_argument("--base", default=DEFAULT_PROFILE, help="profile to copy capacity from")
    fit.add_argument("--prefill-degree", type=int, choices=(1, 2), default=2)


def run(args: argparse.Namespace) -> int:
    if args.verb == "fit-profile":
        return _fit(args)
    setup_logging(args.log_level)
    try:
        load_profile(args.profile)
        if args.chat_template:
            load_chat_template(args.chat_template)
    except (ProfileError, ValueError) as exc:
        return usage_error("kvgate engine", str(exc))
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    try:
        return asyncio.run(_serve(args))
    except ListenError as exc:
        return usage_error("kvgate engine", str(exc))


def _fit(args: argparse.Namespace) -> int:
    from engine.fit import FitError, fit_profile, read_samples

    try:
        with open(args.input, "rb") as f:
            samples = read_samples(f)
        profile, quality = fit_profile(
            samples, args.name, load_profile(args.base), prefill_degree=args.prefill_degree
        )
    except (OSError, FitError, ProfileError) as exc:
        print(f"kvgate engine fit-profile: {exc}", file=sys.stderr)
        return 2
    data = orjson.dumps(profile.to_dict(), option=orjson.OPT_INDENT_2) + b"\n"
    if args.out == "-":
        sys.stdout.write(data.decode())
    else:
        Path(args.out).write_bytes(data)
    print(
        f"fit {args.name}: prefill rms {quality['prefill_rms_ms']:.3f} ms, "
        f"decode rms {quality['decode_rms_ms']:.3f} ms",
        file=sys.stderr,
    )
    return 0


async def _serve(args: argparse.Namespace) -> int:
    from engine.server import EngineServerConfig, serve

    broker = None
    if args.broker:
        import broker as broker_mod

        broker = await broker_mod.connect(args.broker, prefix=args.broker_prefix)
    config = EngineServerConfig(
        engine_id=args.engine_id,
        model=args.model,
        aliases=tuple(args.alias),
        profile=args.profile,
        policy=args.policy,
        scheduler=SchedulerConfig(
            token_budget=args.token_budget,
            chunk_tokens=args.chunk_tokens,
            reject_infeasible=not args.keep_infeasible,
        ),
        default_slo=args.default_slo,
        default_max_tokens=args.default_max_tokens,
        url=args.url_advertised,
        heartbeat_s=args.heartbeat_s,
        chat_template=args.chat_template,
        reject_status=args.reject_status,
        role=args.role,
        kv_link_gbps=args.kv_link_gbps,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )
    try:
        with listening(args.host, args.port):
            runner, url = await serve(config, broker, host=args.host, port=args.port)
    except ListenError:
        if broker is not None:
            with contextlib.suppress(Exception):
                await broker.close()
        raise
    log.info("engine %s serving %s on %s (policy %s)", args.engine_id, args.model, url, args.policy)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        if broker is not None:
            with contextlib.suppress(Exception):
                await broker.close()
    return 0
