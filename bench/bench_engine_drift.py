"""How far the live engine's token delivery drifts from its scheduler's timeline, under load.

    .venv/bin/python -m bench.bench_engine_drift [--rates 5,10,20] [--duration 10]

For each rate: start ``kvgate engine`` in its own process on 127.0.0.1, send open-loop Poisson
streaming completions from this process (shared system prompts, unique questions, 32-256 output
tokens, the engine's default relaxed SLO), read every stream to the end, then read the engine's
own drift figures from ``/server_info`` (``kvgate.delivery_drift``: the delay between the time the
core says a token was produced and the moment the server hands it to the response stream, over
the last 20,000 tokens). Saves ``results/engine_drift.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

RESULT = Path("results/engine_drift.json")
SYSTEM_PROMPTS = [f"System prompt {i}: you are a helpful assistant. " * 20 for i in range(4)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError("engine did not become healthy")


async def _one(s: aiohttp.ClientSession, url: str, body: dict, stats: dict) -> None:
    """One streamed completion, read to the end; counts its SSE data events. Reads whole
    buffers and counts event starts in bytes (not line by line): the load generator shares the
    2 cores with the engine, and its own CPU time would otherwise show up as engine drift."""
    marker = b"\n\ndata: {"
    try:
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                stats["errors"] += 1
                return
            tail = b"\n\n"  # the stream starts like an event boundary
            while chunk := await r.content.readany():
                data = tail + chunk
                stats["chunks"] += data.count(marker)
                tail = data[-(len(marker) - 1) :]
        stats["ok"] += 1
    except aiohttp.ClientError:
        stats["errors"] += 1


def _engine_cpus(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(engine CPUs, load generator CPUs) when pinning: the first CPU for the engine, the rest
    for the load generator, so that the load generator's own work (woken by every token write)
    does not preempt the engine it measures. None: no pinning (or fewer than 2 CPUs)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


async def run_level(
    rate: float, duration: float, seed: int, policy: str, pin: bool = False
) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kvgate",
        "engine",
        "--port",
        str(port),
        "--engine-id",
        f"drift-{rate:g}",
        "--policy",
        policy,
        "--log-level",
        "warning",
    ]
    engine_cpus, client_cpus = _engine_cpus(pin)
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=(lambda: os.sched_setaffinity(0, engine_cpus)) if engine_cpus else None,
    )
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    try:
        await _wait_healthy(url, proc)
        rng = random.Random(seed)
        stats = {"ok": 0, "errors": 0, "chunks": 0}
        tasks = []
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            t0 = time.monotonic()
            t = 0.0
            i = 0
            while True:
                t += rng.expovariate(rate)
                if t >= duration:
                    break
                await asyncio.sleep(max(t0 + t - time.monotonic(), 0))
                body = {
                    "model": "kvgate-sim",
                    "prompt": rng.choice(SYSTEM_PROMPTS) + f"Question {seed}-{i}? " * 10,
                    "max_tokens": rng.randint(32, 256),
                    "stream": True,
                }
                tasks.append(asyncio.create_task(_one(s, url, body, stats)))
                i += 1
            await asyncio.gather(*tasks)
            elapsed = time.monotonic() - t0
            async with s.get(url + "/server_info") as r:
                info = (await r.json())["kvgate"]
        return {
            "rate": rate,
            "requests": len(tasks),
            "ok": stats["ok"],
            "errors": stats["errors"],
            "tokens_per_s": stats["chunks"] / elapsed,
            "drift": info["delivery_drift"],
            "pinned": engine_cpus is not None,
        }
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if proc.poll() is None:
            proc.kill()


def _run(coro):  # uvloop when installed: a cheaper load generator, as for the engine itself
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="5,10,20", help="requests/s, one engine each")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate")
    ap.add_argument("--policy", default="slo")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--pin",
        action="store_true",
        help="engine on the first CPU, load generator on the others (see _engine_cpus)",
    )
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)
    load_at_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    levels = []
    for rate in (float(x) for x in args.rates.split(",")):
        res = _run(run_level(rate, args.duration, args.seed, args.policy, args.pin))
        d = res["drift"]
        print(
            f"rate {rate:5.1f}/s: {res['ok']}/{res['requests']} ok, "
            f"{res['tokens_per_s']:6.0f} tokens/s, drift p50 {d['p50_ms']:.2f} ms, "
            f"p99 {d['p99_ms']:.2f} ms, max {d['max_ms']:.2f} ms ({d['samples']} tokens)",
            flush=True,
        )
        levels.append(res)
    out = {
        "benchmark": "engine_drift",
        "policy": args.policy,
        "pinned": args.pin,
        "load_average_at_start": load_at_start,
        "levels": levels,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
