"""A Kubernetes exec probe for kvgate processes that serve no HTTP, such as the vLLM bridge.

    python -m deploy.probe --broker URL [--broker-prefix P] --engine-id ID

Exits 0 when the engine's registration on the broker is fresh. A reporter (the bridge's)
renews it every few seconds from its publishing loop, so a fresh registration shows that the
loop runs and reaches the broker; a hung or crashed bridge lets it expire within its TTL.
Any failure (broker unreachable, bad URL, timeout) exits 1 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.probe",
        description="exit 0 when ENGINE_ID is registered (alive) on the kvgate broker",
    )
    parser.add_argument("--broker", required=True, help="kvgate broker URL")
    parser.add_argument("--broker-prefix", default="kvgate:", help="key prefix (%(default)s)")
    parser.add_argument("--engine-id", required=True, help="the engine whose reporter to check")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (%(default)s)")
    return parser


async def engine_registered(url: str, prefix: str, engine_id: str) -> bool:
    import broker

    brk = await broker.connect(url, prefix=prefix)
    try:
        return engine_id in await brk.engines()
    finally:
        await brk.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        alive = asyncio.run(
            asyncio.wait_for(
                engine_registered(args.broker, args.broker_prefix, args.engine_id), args.timeout
            )
        )
    except Exception as exc:  # a probe reports every failure as "not alive", never a traceback
        print(f"probe: broker check failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not alive:
        print(f"probe: engine {args.engine_id} is not registered on the broker", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
