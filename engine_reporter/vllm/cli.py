"""``kvgate bridge vllm``: run one bridge next to one vLLM engine (see docs/vllm.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvgate.cli_support import broker_url, usage_error
from kvgate.cost_model import DEFAULT_PROFILE
from kvgate.logs import setup_logging

if TYPE_CHECKING:
    from engine_reporter.vllm.bridge import BridgeConfig

log = logging.getLogger("kvgate.bridge.vllm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvgate bridge``: one nested verb per engine kind (only ``vllm`` today)."""
    kinds = parser.add_subparsers(dest="bridge_kind", metavar="ENGINE", required=True)
    p = kinds.add_parser(
        "vllm",
        help="bridge a vLLM engine's KV events and /metrics into kvgate",
        description=(
            "Subscribe to a vLLM engine's KV cache events (--kv-events-config publisher zmq), "
            "map its token ids to prompt bytes with the model's tokenizer, and publish kvgate "
            "block events, snapshots and load heartbeats for that engine."
        ),
    )
    p.add_argument(
        "--zmq",
        required=True,
        metavar="ENDPOINT",
        help="vLLM's KV event endpoint (its kv-events-config 'endpoint'), e.g. "
        "tcp://127.0.0.1:5557 or ipc:///run/vllm/kv.pub",
    )
    p.add_argument(
        "--zmq-bind",
        action="store_true",
        help="bind the endpoint instead of connecting: needed when vLLM is given a concrete "
        "tcp://HOST:PORT (vLLM binds only for tcp://*:P, ipc:// and inproc://, else connects)",
    )
    p.add_argument(
        "--replay",
        metavar="ENDPOINT",
        help="vLLM's replay endpoint (kv-events-config 'replay_endpoint'), to recover missed "
        "batches and catch up at start; strongly recommended",
    )
    p.add_argument(
        "--topic", default="", help="only messages with this topic prefix (default: all)"
    )
    p.add_argument(
        "--model-dir",
        required=True,
        type=Path,
        help="the model folder vLLM serves (tokenizer.json, tokenizer_config.json), read offline",
    )
    p.add_argument(
        "--engine-url",
        required=True,
        help="vLLM's OpenAI base URL, e.g. http://127.0.0.1:8000 (for /metrics, /v1/models, "
        "and announced to the router as the engine's address)",
    )
    p.add_argument(
        "--engine-id",
        help="the engine id kvgate uses for this vLLM (default: vllm-HOST-PORT of --engine-url); "
        "must match a static --engine ID=URL given to the gateway, if any",
    )
    p.add_argument(
        "--broker", type=broker_url, default="redis://127.0.0.1:6379/0", help="kvgate broker URL"
    )
    p.add_argument("--broker-prefix", default="kvgate:", help="key prefix on the broker")
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help="cost profile name or JSON path announced for this engine (default: %(default)s)",
    )
    p.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="the engine's part in a prefill/decode disaggregated fleet, announced in its "
        "heartbeats (prefill and decode need a vLLM started with a --kv-transfer-config "
        "connector; default: %(default)s)",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        metavar="N",
        help="vLLM's --max-num-batched-tokens (the most prompt tokens it prefills in one step), "
        "announced so that routers price a long prompt chunk by chunk, each chunk attending to "
        "the ones before it (default: not announced; routers price a prompt in one piece)",
    )
    p.add_argument(
        "--served-model",
        action="append",
        default=[],
        metavar="NAME",
        help="served model name (repeatable); default: read from /v1/models",
    )
    p.add_argument(
        "--poll-ms",
        type=float,
        default=200.0,
        help="how often to scrape vLLM's /metrics for load, ms (default: %(default)s)",
    )
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=1.0,
        help="publish a heartbeat at least this often even if the load did not change",
    )
    p.add_argument("--replay-timeout-s", type=float, default=2.0)
    p.add_argument("--log-level", default="info")
    p.set_defaults(_run=run)


def default_engine_id(url: str) -> str:
    """``vllm-HOST-PORT`` from an engine URL."""
    parts = urlsplit(url)
    host = (parts.hostname or "localhost").replace(":", "_")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"vllm-{host}-{port}"


def build_config(args: argparse.Namespace) -> BridgeConfig:
    """The bridge's config from parsed arguments (zmq and aiohttp load only when it runs)."""
    from engine_reporter.vllm.bridge import BridgeConfig

    if args.poll_ms <= 0 or args.heartbeat_s <= 0 or args.replay_timeout_s <= 0:
        raise SystemExit("--poll-ms, --heartbeat-s and --replay-timeout-s must be positive")
    if args.prefill_chunk_tokens is not None and args.prefill_chunk_tokens < 1:
        raise SystemExit("--prefill-chunk-tokens must be at least 1")
    return BridgeConfig(
        zmq_endpoint=args.zmq,
        zmq_bind=args.zmq_bind,
        replay_endpoint=args.replay,
        topic=args.topic,
        model_dir=args.model_dir,
        engine_id=args.engine_id or default_engine_id(args.engine_url),
        engine_url=args.engine_url.rstrip("/"),
        profile=args.profile,
        role=args.role,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        models=tuple(args.served_model),
        metrics_interval_s=args.poll_ms / 1000.0,
        heartbeat_interval_s=args.heartbeat_s,
        replay_timeout_s=args.replay_timeout_s,
    )


async def _serve(args: argparse.Namespace) -> int:
    import broker
    from engine_reporter.vllm.bridge import VllmBridge
    from engine_reporter.vllm.tokens import TokenizerError

    config = build_config(args)
    try:
        brk = await broker.connect(args.broker, prefix=args.broker_prefix)
    except ValueError as exc:
        log.error("bad --broker URL: %s", exc)
        return 2
    try:
        bridge = VllmBridge(config, brk)
    except (TokenizerError, OSError, ValueError) as exc:
        log.error("cannot load the tokenizer from %s: %s", config.model_dir, exc)
        await brk.close()
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await bridge.start()
    try:
        await stop.wait()
    finally:
        log.info("bridge %s: stopping", config.engine_id, extra=bridge.stats.as_dict())
        await bridge.close()
        await brk.close()
    return 0


# What the bridge imports from kvgate's optional ``vllm`` extra (pyproject.toml): a plain
# ``pip install kvgate`` lacks them.
VLLM_EXTRA_MODULES = ("zmq", "msgspec")


def missing_extra() -> list[str]:
    """The ``vllm`` extra's modules that cannot be imported here."""
    missing = []
    for module in VLLM_EXTRA_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


def run(args: argparse.Namespace) -> int:
    missing = missing_extra()
    if missing:
        return usage_error(
            "kvgate bridge vllm",
            f"the vLLM bridge needs kvgate's 'vllm' extra (missing: {', '.join(missing)}): "
            "pip install 'kvgate[vllm]'",
        )
    setup_logging(args.log_level)
    return asyncio.run(_serve(args))
