"""``kvgate demo``: the gateway, the router and simulated engines in one process, e2 against
round robin on a short built-in workload with shared prefixes.

Each policy gets a fresh stack on the embedded in-process broker (no Redis needed): ``--engines``
simulated engines (``engine.server``, each with its SLO scheduler, prefix cache and reporter),
the router (``router.core.Router`` in ``router.service.EmbeddedRouter``) and the gateway, all on
free 127.0.0.1 ports. The workload (``bench.workloads.synthetic``) mixes multi-turn chat sessions
(each turn resends the history behind a shared system prompt) with tool-use requests (a few
long shared tool prompts with Zipf popularity); it is replayed open-loop through the gateway with
streaming (``bench.replay``), and the table compares TTFT/TPOT percentiles, SLO attainment,
prefix hit rate (``usage.prompt_tokens_details.cached_tokens``) and requests per engine.

``kvgate demo --serve`` starts one stack (e2) and leaves it running for your own client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson
from aiohttp import web

from gateway.app import GATEWAY_KEY, Gateway, create_app, serve
from gateway.config import GatewayConfig
from gateway.routing import embedded_routing
from kvgate.cli_support import (
    ListenError,
    listening,
    port,
    positive_float,
    positive_int,
    usage_error,
)
from kvgate.logs import setup_logging
from kvgate.slo import SLO_CLASSES

log = logging.getLogger("kvgate.demo")
MODEL = "kvgate-sim"
POLICIES = ("e2", "round_robin")


@dataclass(frozen=True, slots=True)
class DemoOptions:
    engines: int = 4
    duration_s: float = 20.0  # arrivals span this long; the run ends when the last answer does
    rate: float = 16.0  # requests per second offered, all families together
    max_requests: int = 320
    seed: int = 0
    policies: tuple[str, ...] = POLICIES


@dataclass(slots=True)
class Stack:
    """One demo stack; ``url`` is the gateway's base URL."""

    url: str
    gateway: Gateway
    engine_urls: list[str]
    router: object


def build_workload(opts: DemoOptions) -> list:
    """The built-in workload: 60% multi-turn chat, 40% tool use, seeded, arrival-sorted."""
    from bench.workloads import limit, merge
    from bench.workloads.synthetic import multi_turn_chat, tool_use

    chat = multi_turn_chat(
        opts.rate * 0.6,
        opts.duration_s,
        seed=opts.seed,
        mean_turns=4.0,
        think_time_s=3.0,
        system_tokens=600,
        user_tokens=80,
        output_tokens=40,
        slo=SLO_CLASSES["search"],
        model=MODEL,
    )
    tools = tool_use(
        opts.rate * 0.4,
        opts.duration_s,
        seed=opts.seed,
        n_tools=24,
        tool_tokens=1600,
        question_tokens=100,
        output_tokens=24,
        slo=SLO_CLASSES["image"],
        model=MODEL,
    )
    return limit(merge(chat, tools), opts.max_requests)


@asynccontextmanager
async def demo_stack(
    policy: str, n_engines: int, seed: int = 0, port: int = 0
) -> AsyncIterator[Stack]:
    """Engines, router and gateway on one fresh in-process broker; torn down on exit.
    ``policy`` is a spec: a name, an ablation alias or ``name[option=value,...]``."""
    from bench.sim.policies import parse_policy
    from broker import MemoryBroker
    from engine.server import EngineServerConfig
    from engine.server import serve as serve_engine

    broker = MemoryBroker()
    runners: list[web.AppRunner] = []
    engine_urls: list[str] = []
    try:
        for i in range(n_engines):
            runner, url = await serve_engine(
                EngineServerConfig(engine_id=f"engine-{i}", model=MODEL), broker
            )
            runners.append(runner)
            engine_urls.append(url)
        name, options = parse_policy(policy)
        extra = {"policy_options": options}
        async with embedded_routing(broker, policy=name, seed=seed, router_config=extra) as routing:
            config = GatewayConfig(
                port=0, debug_header=True, access_log=False, refresh_interval_s=0.5
            )
            app = create_app(
                config,
                routing.service,
                stats=routing.stats,
                on_drain=routing.on_drain,
            )
            with listening("127.0.0.1", port):
                gw_runner, port = await serve(app, "127.0.0.1", port, drain_timeout_s=5.0)
            gateway = app[GATEWAY_KEY]
            try:
                await _wait_for_engines(gateway, n_engines)
                yield Stack(f"http://127.0.0.1:{port}", gateway, engine_urls, routing.router)
            finally:
                await gw_runner.cleanup()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        with contextlib.suppress(Exception):
            await broker.close()


async def _wait_for_engines(gateway: Gateway, n: int, timeout_s: float = 15.0) -> None:
    """Until the router has heard every engine's heartbeat (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await gateway.refresh_engines()
        alive = sum(1 for e in gateway.pool.engines.values() if e.router_alive and e.models)
        if alive >= n:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {alive} of {n} engines registered with the router")
        await asyncio.sleep(0.1)


async def run_policy(policy: str, workload: Sequence, opts: DemoOptions) -> dict:
    """One fresh stack, the whole workload through it; the replay summary plus the route mix."""
    from bench.replay import ReplayConfig, replay

    async with demo_stack(policy, opts.engines, opts.seed) as stack:
        cfg = ReplayConfig(
            base_url=stack.url,
            model=MODEL,
            progress=False,
            max_duration_s=opts.duration_s + 1.0,
            request_timeout_s=60.0,
            drain_timeout_s=30.0,
        )
        result = await replay(workload, cfg)
        summary = result.summary
        summary["policy"] = policy
        summary["per_engine_requests"] = {
            e.engine_id: e.served
            for e in sorted(stack.gateway.pool.engines.values(), key=lambda e: e.engine_id)
        }
        return summary


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def format_table(summaries: Sequence[dict]) -> str:
    """The result table: one row per policy."""
    head = (
        f"{'policy':<12}{'ok/req':>9}{'TTFT p50':>10}{'p90':>7}{'p99':>7}"
        f"{'TPOT p50':>10}{'p90':>6}{'p99':>6}{'429':>5}{'SLO met':>9}{'hit rate':>10}"
        "  per-engine requests"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        ttft, tpot = s.get("ttft_ms", {}), s.get("tpot_ms", {})
        hit = s.get("prefix_hit_rate")
        loads = "/".join(str(v) for v in s.get("per_engine_requests", {}).values())
        lines.append(
            f"{s['policy']:<12}{str(s.get('ok', 0)) + '/' + str(s.get('requests', 0)):>9}"
            f"{_f(ttft.get('p50')):>10}{_f(ttft.get('p90')):>7}{_f(ttft.get('p99')):>7}"
            f"{_f(tpot.get('p50')):>10}{_f(tpot.get('p90')):>6}{_f(tpot.get('p99')):>6}"
            f"{s.get('status', {}).get('429', 0):>5}"
            f"{_f(100 * s.get('slo_attainment', 0.0), 1) + '%':>9}"
            f"{(_f(100 * hit, 1) + '%') if hit is not None else '-':>10}  {loads}"
        )
    lines.append(
        "(times in ms; 429 = shed by the router or rejected by an engine's SLO scheduler;"
        " SLO met = TTFT and TPOT within each request's class objective)"
    )
    return "\n".join(lines)


async def compare(opts: DemoOptions) -> list[dict]:
    workload = build_workload(opts)
    kinds: dict[str, int] = {}
    for r in workload:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    print(
        f"kvgate demo: {len(workload)} requests ({', '.join(f'{v} {k}' for k, v in kinds.items())})"
        f" over {opts.duration_s:.0f} s, {opts.engines} simulated engines, "
        f"policies {', '.join(opts.policies)}",
        flush=True,
    )
    out = []
    for policy in opts.policies:
        t0 = time.monotonic()
        print(f"  running {policy} ...", end="", flush=True)
        summary = await run_policy(policy, workload, opts)
        print(f" done in {time.monotonic() - t0:.0f} s", flush=True)
        out.append(summary)
    return out


async def serve_demo(opts: DemoOptions, policy: str, port: int) -> int:
    async with demo_stack(policy, opts.engines, opts.seed, port) as stack:
        print(
            f"kvgate demo stack is up: gateway {stack.url} (policy {policy}, model {MODEL!r}, "
            f"{opts.engines} simulated engines)\n"
            f"  OPENAI_BASE_URL={stack.url}/v1 OPENAI_API_KEY=none  (any key works)\n"
            f"  curl -s {stack.url}/v1/chat/completions -H 'content-type: application/json' "
            f'-H \'x-kvgate-debug: 1\' -d \'{{"model":"{MODEL}","messages":'
            f'[{{"role":"user","content":"hello"}}]}}\'\n'
            f"  metrics: {stack.url}/metrics   Ctrl-C stops it",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoOptions()
    parser.add_argument(
        "--engines", type=positive_int, default=d.engines, help="simulated engines (4)"
    )
    parser.add_argument(
        "--duration", type=positive_float, default=d.duration_s, help="seconds of arrivals"
    )
    parser.add_argument(
        "--rate", type=positive_float, default=d.rate, help="requests/s offered (16)"
    )
    parser.add_argument("--max-requests", type=positive_int, default=d.max_requests)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--policies",
        default=",".join(d.policies),
        help="comma-separated policy specs: names, ablation aliases (e2-by-load) or "
        "name[option=value,...] (e2,round_robin)",
    )
    parser.add_argument("--json", type=Path, help="also write the summaries as JSON here")
    parser.add_argument(
        "--serve", action="store_true", help="start one stack and leave it running for your client"
    )
    parser.add_argument("--policy", default="e2", help="the --serve stack's policy (e2)")
    parser.add_argument("--port", type=port, default=0, help="the --serve gateway's port (free)")
    parser.add_argument("--log-level", default="warning")


def check_policies(specs: Sequence[str]) -> str | None:
    """What is wrong with the first bad policy spec (unknown name, alias or option, a value of
    the wrong type), or None: checked before any stack starts, so a typo is a one-line error,
    not a traceback."""
    from bench.sim.policies import check_policy

    for spec in specs:
        try:
            check_policy(spec)
        except ValueError as exc:  # PolicyError is a ValueError
            return f"policy {spec!r}: {exc}"
    return None


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    opts = DemoOptions(
        engines=args.engines,
        duration_s=args.duration,
        rate=args.rate,
        max_requests=args.max_requests,
        seed=args.seed,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
    )
    problem = check_policies([args.policy] if args.serve else opts.policies)
    if problem is not None:
        print(f"kvgate demo: {problem}", file=sys.stderr)
        return 2
    if args.serve:
        try:
            return asyncio.run(serve_demo(opts, args.policy, args.port))
        except ListenError as exc:
            return usage_error("kvgate demo", str(exc))
    summaries = asyncio.run(compare(opts))
    print()
    print(format_table(summaries))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(summaries, option=orjson.OPT_INDENT_2))
        print(f"saved {args.json}")
    return 0 if all(s.get("ok") for s in summaries) else 1


if __name__ == "__main__":
    from kvgate.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
