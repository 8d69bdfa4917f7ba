"""Gateway overhead: latency added and throughput, against going direct and against peer routers.

    .venv/bin/python -m bench.bench_gateway [--quick]  -> results/gateway.json

Targets, all fronting the same upstream engines in the same run: ``direct`` (the client spreads
requests over the engines itself), ``kvgate`` (``kvgate gateway`` as its own process, static
engines, embedded router; ``kvgate-wN`` the same with ``--workers N``; ``kvgate-busy-poll``
one worker with the opt-in ``--busy-poll``, see ``gateway/busypoll.py``), ``sglang-router`` and
``vllm-router`` (pip packages, round robin). Each runs as its own process on loopback. Every
kvgate target uses the same real Redis broker (a private ``redis-server`` on a loopback port,
started by the benchmark unless ``--broker-url`` names one), since more than one worker needs a
shared broker; the engines publish nothing, so the broker only carries the routers' idle reads.

The upstream is an instant OpenAI-compatible server in its own process (``upstream`` verb
below): it answers as soon as it has read the request, so what is measured is the proxies' cost
rather than an engine's timing noise. It also answers the probes peer routers make (``/health``,
``/get_server_info``, ``/get_model_info``, ...). Streams send ``--chunks`` SSE events
``--gap-ms`` apart, so a proxy that holds small writes back (Nagle + delayed ACK, ~40 ms) shows.
The events are paced by the clock (event i is due ``i * gap`` after the first), as an engine's
decode steps are, so time the upstream spends descheduled while a proxy on the same cores runs
does not pile up over the stream.

Phases, interleaved by round so that a noisy neighbour hurts every target alike:
* latency: one client connection, reused (keep-alive), one request at a time; before each
  streamed request the client pauses a random 0 to ``--phase-jitter-ms`` (the same seeded
  sequence for every target). Why: the upstream's timers tick in whole milliseconds, and a
  request sent the moment the previous stream ended lands at a phase of that tick set by the
  proxy's own round-trip time, so each target's stream length would carry a fixed bias of up
  to a tick; a random phase makes it the same average for every target;
* throughput: ``--concurrency`` connections, a fixed number of requests, requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from kvgate.stats import percentile

RESULTS = Path("results/gateway.json")
MODEL = "bench-model"
LOOPBACK = "127.0.0.1"


# ---- the instant upstream (its own process) ---------------------------------------------------


def upstream_app(chunks: int, gap_ms: float) -> web.Application:
    """An OpenAI-compatible server that answers at once (see the module docstring)."""
    usage = {"prompt_tokens": 8, "completion_tokens": chunks, "total_tokens": 8 + chunks}

    async def complete(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok " * chunks},
                    "finish_reason": "stop",
                }
                if chat
                else {"index": 0, "text": "ok " * chunks, "finish_reason": "stop"}
            )
            out = {
                "id": "b",
                "object": "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [choice],
                "usage": usage,
            }
            return web.Response(body=orjson.dumps(out), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        t0 = time.perf_counter()
        for i in range(chunks):
            piece = (
                {"index": 0, "delta": {"content": "ok "}} if chat else {"index": 0, "text": "ok "}
            )
            piece["finish_reason"] = "stop" if i == chunks - 1 else None
            ev = {
                "id": "b",
                "object": "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [piece],
            }
            await resp.write(b"data: " + orjson.dumps(ev) + b"\n\n")
            if gap_ms and i < chunks - 1:
                # Event i+1 is due at t0 + (i+1) * gap: paced by the clock, as an engine's
                # decode steps are, so the time this process spent descheduled (the proxy in
                # front of it runs on the same cores) does not pile up across the stream.
                await asyncio.sleep(max(0.0, t0 + (i + 1) * gap_ms / 1000 - time.perf_counter()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": MODEL, "served_model_name": MODEL})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": MODEL, "is_generation": True})

    async def load(request: web.Request) -> web.Response:
        return web.json_response({"load": 0})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/v1/models", models)
    for path in ("/health", "/health_generate", "/readiness", "/liveness"):
        app.router.add_get(path, ok)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, server_info)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/get_load", load)
    return app


async def _serve_upstream(ports: list[int], chunks: int, gap_ms: float) -> None:
    runners = []
    for port in ports:
        runner = web.AppRunner(upstream_app(chunks, gap_ms), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, LOOPBACK, port).start()
        runners.append(runner)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for r in runners:
        await r.cleanup()


# ---- processes --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@dataclass
class Target:
    name: str
    url: str
    argv: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    error: str | None = None
    version: str | None = None
    log_path: Path | None = None


def _start(argv: list[str], log_path: Path) -> subprocess.Popen:
    fh = open(log_path, "wb")  # noqa: SIM115 - closed when the process is stopped
    return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


async def _wait_ready(session: aiohttp.ClientSession, t: Target, timeout_s: float) -> None:
    """Ready when a completion goes through (peers may answer /health before their workers)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if t.proc is not None and t.proc.poll() is not None:
            raise RuntimeError(f"exited with {t.proc.returncode}: {_tail(t.log_path)}")
        try:
            async with session.post(
                t.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}
            ) as r:
                await r.read()
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except (aiohttp.ClientError, OSError) as exc:
            last = repr(exc)
        await asyncio.sleep(0.25)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s ({last}): {_tail(t.log_path)}")


def _tail(path: Path | None, n: int = 600) -> str:
    if path is None or not path.exists():
        return ""
    return path.read_bytes()[-n:].decode("utf-8", "replace")


def _pip_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# ---- the load ---------------------------------------------------------------------------------


def _body(stream: bool) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "prompt": "Say something short.", "max_tokens": 8, "stream": stream}
    )


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool
) -> tuple[float, float]:
    """(time to first body byte, time to the end), seconds; raises on a non-200."""
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        if stream:
            first = await r.content.readany()
            t1 = time.perf_counter()
            rest = await r.read()
            data = first + rest
        else:
            data = await r.read()
            t1 = time.perf_counter()
        if r.status != 200 or (stream and not data.endswith(b"[DONE]\n\n")):
            raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
    return t1 - t0, time.perf_counter() - t0


async def latency_batch(
    urls: list[str],
    stream: bool,
    n: int,
    pick: Callable[[int], str],
    jitter_s: float = 0.0,
    seed: int = 0,
) -> tuple[list[float], list[float]]:
    """``n`` sequential requests over one reused connection per URL; a random pause of up to
    ``jitter_s`` before each (see the module docstring)."""
    body = _body(stream)
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=len(urls), force_close=False)
    async with aiohttp.ClientSession(connector=conn) as s:
        await _one(s, pick(0), body, stream)  # open (and warm) the connection
        firsts, totals = [], []
        for i in range(n):
            if jitter_s:
                # Blocking on purpose: asyncio's sleep is as millisecond-grained as the
                # upstream's timers; nothing else runs in this process meanwhile.
                time.sleep(rng.random() * jitter_s)
            f, t = await _one(s, pick(i), body, stream)
            firsts.append(f)
            totals.append(t)
    return firsts, totals


async def throughput_batch(
    pick: Callable[[int], str], stream: bool, n: int, concurrency: int
) -> tuple[float, int]:
    """Requests/s of ``n`` requests over ``concurrency`` workers; and how many failed."""
    body = _body(stream)
    conn = aiohttp.TCPConnector(limit=concurrency)
    failures = 0
    counter = iter(range(n))
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            nonlocal failures
            for i in counter:
                try:
                    await _one(s, pick(i), body, stream)
                except (RuntimeError, aiohttp.ClientError, OSError):
                    failures += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return n / wall, failures


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 0.5) * 1e3, 4),
        "p90": round(percentile(values, 0.9) * 1e3, 4),
        "p99": round(percentile(values, 0.99) * 1e3, 4),
        "mean": round(sum(values) / len(values) * 1e3, 4),
    }


async def run_bench(args: argparse.Namespace) -> dict:
    py = sys.executable
    engine_ports = [free_port() for _ in range(args.engines)]
    engine_urls = [f"http://{LOOPBACK}:{p}" for p in engine_ports]
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    upstream = _start(
        [
            py,
            "-m",
            "bench.bench_gateway",
            "upstream",
            "--ports",
            *map(str, engine_ports),
            "--chunks",
            str(args.chunks),
            "--gap-ms",
            str(args.gap_ms),
        ],
        logs / "upstream.log",
    )
    targets: list[Target] = []
    for i, url in enumerate(engine_urls):
        targets.append(Target(f"direct-{i}", url))
    redis_proc = None
    broker_url = args.broker_url
    if broker_url is None:
        try:
            redis_proc, broker_url = _start_redis(logs)
        except RuntimeError:
            _stop(upstream)
            raise
    variants = [(_kvgate_name(w), w, ()) for w in args.workers]
    if args.busy_poll:
        variants.append(("kvgate-busy-poll", 1, ("--busy-poll",)))
    for name, workers, extra in variants:
        gw_port = free_port()
        targets.append(
            Target(
                name,
                f"http://{LOOPBACK}:{gw_port}",
                [
                    py,
                    "-m",
                    "kvgate.cli",
                    "gateway",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(gw_port),
                    "--workers",
                    str(workers),
                    "--broker-url",
                    broker_url,
                    "--broker-prefix",
                    f"kvgate-bench-{os.getpid()}-{name}:",
                    "--policy",
                    args.kvgate_policy,
                    # --access-log: one JSON line per request into the target's log file
                    *(
                        ("--log-level", "info")
                        if args.access_log
                        else ("--no-access-log", "--log-level", "warning")
                    ),
                    *extra,
                    *(
                        a
                        for i, u in enumerate(engine_urls)
                        for a in ("--engine", f"u{i}={u},{MODEL}")
                    ),
                ],
                version="local",
            )
        )
    sg_bin = shutil.which("sglang-router", path=str(Path(py).parent)) and py
    if sg_bin and _pip_version("sglang-router"):
        port = free_port()
        targets.append(
            Target(
                "sglang-router",
                f"http://{LOOPBACK}:{port}",
                [
                    py,
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(port),
                    "--worker-urls",
                    *engine_urls,
                    "--policy",
                    "round_robin",
                    "--log-level",
                    "warn",
                    "--prometheus-port",
                    str(free_port()),
                    "--prometheus-host",
                    LOOPBACK,
                ],
                version=_pip_version("sglang-router"),
            )
        )
    else:
        targets.append(
            Target("sglang-router", "", error="not installed (pip install sglang-router)")
        )
    vr_bin = shutil.which("vllm-router", path=str(Path(py).parent))
    if vr_bin:
        port = free_port()
        targets.append(
            Target(
                "vllm-router",
                f"http://{LOOPBACK}:{port}",
                [
                    vr_bin,
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(port),
                    "--worker-urls",
                    *engine_urls,
                    "--policy",
                    "round_robin",
                    "--log-level",
                    "warning",
                    "--prometheus-port",
                    str(free_port()),
                    "--prometheus-host",
                    LOOPBACK,
                ],
                version=_pip_version("vllm-router"),
            )
        )
    else:
        targets.append(Target("vllm-router", "", error="not installed (pip install vllm-router)"))

    result: dict = {
        "benchmark": "gateway overhead",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "note": "shared 2-core machine; other agents were running: noisy",
        },
        "params": vars(args) | {"engines_urls": engine_urls, "broker": broker_url},
        "targets": {},
    }
    try:
        for t in targets:
            if t.argv:
                t.log_path = logs / f"{t.name}.log"
                t.proc = _start(t.argv, t.log_path)
        async with aiohttp.ClientSession() as s:
            for t in targets:
                if t.error is None:
                    try:
                        await _wait_ready(s, t, args.ready_timeout)
                    except RuntimeError as exc:
                        t.error = str(exc)
                        print(f"{t.name}: {t.error}", file=sys.stderr)
        live = [t for t in targets if t.error is None and not t.name.startswith("direct-")]
        direct_ok = all(t.error is None for t in targets if t.name.startswith("direct-"))
        if not direct_ok:
            raise RuntimeError("the upstream did not start: " + _tail(logs / "upstream.log"))
        # "direct" spreads over the engines itself, as a proxy would.
        named: dict[str, Callable[[int], str]] = {
            "direct": lambda i: engine_urls[i % len(engine_urls)] + "/v1/completions"
        }
        for t in live:
            named[t.name] = (lambda base: lambda i: base + "/v1/completions")(t.url)
        stats: dict[str, dict] = {}
        for stream in (False, True):
            mode = "stream" if stream else "non_stream"
            firsts: dict[str, list[float]] = {k: [] for k in named}
            totals: dict[str, list[float]] = {k: [] for k in named}
            rps: dict[str, list[float]] = {k: [] for k in named}
            fails: dict[str, int] = dict.fromkeys(named, 0)
            for rnd in range(args.rounds):
                for name, pick in named.items():
                    urls = engine_urls if name == "direct" else [pick(0)]
                    jitter = args.phase_jitter_ms / 1000 if stream and args.gap_ms else 0.0
                    f, tt = await latency_batch(
                        urls, stream, args.latency_requests, pick, jitter, seed=rnd
                    )
                    firsts[name] += f
                    totals[name] += tt
                    r, nf = await throughput_batch(
                        pick, stream, args.throughput_requests, args.concurrency
                    )
                    rps[name].append(r)
                    fails[name] += nf
                print(f"{mode}: round {rnd + 1}/{args.rounds} done", file=sys.stderr)
            for name in named:
                stats.setdefault(name, {})[mode] = {
                    "latency_ms": _ms(totals[name]),
                    "first_byte_ms": _ms(firsts[name]),
                    "throughput_rps": round(sorted(rps[name])[len(rps[name]) // 2], 1),
                    "throughput_rps_rounds": [round(x, 1) for x in rps[name]],
                    "failed_requests": fails[name],
                    "requests": len(totals[name]) + args.throughput_requests * args.rounds,
                }
        for name, st in stats.items():
            for mode, m in st.items():
                if name != "direct":
                    d = stats["direct"][mode]
                    m["added_p50_ms"] = round(m["latency_ms"]["p50"] - d["latency_ms"]["p50"], 4)
                    m["added_p99_ms"] = round(m["latency_ms"]["p99"] - d["latency_ms"]["p99"], 4)
                    m["added_first_byte_p50_ms"] = round(
                        m["first_byte_ms"]["p50"] - d["first_byte_ms"]["p50"], 4
                    )
            result["targets"][name] = {"results": st}
        for t in targets:
            if not t.name.startswith("direct-"):
                entry = result["targets"].setdefault(t.name, {})
                entry["version"] = t.version
                if t.error:
                    entry["error"] = t.error
        result["targets"]["direct"]["engines"] = engine_urls
        result["summary"] = _summary(result["targets"])
    finally:
        for t in targets:
            _stop(t.proc)
        _stop(upstream)
        _stop(redis_proc)
    return result


def _kvgate_name(workers: int) -> str:
    return "kvgate" if workers == 1 else f"kvgate-w{workers}"


def _start_redis(logs: Path) -> tuple[subprocess.Popen, str]:
    """A private, non-persistent redis-server on a free loopback port, for the kvgate targets."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found (apt-get install redis-server) or --broker-url")
    port = free_port()
    proc = _start(
        [binary, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"],
        logs / "redis.log",
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://{LOOPBACK}:{port}/0"
        except OSError:
            pass
        time.sleep(0.05)
    _stop(proc)
    raise RuntimeError("redis-server did not start: " + _tail(logs / "redis.log"))


def _summary(targets: dict) -> dict:
    """The figures the issue's targets are stated in: ``kvgate`` (one worker, default settings)
    at the top level of each mode, every kvgate target (``kvgate-wN``, ``kvgate-busy-poll``)
    under ``by_workers``."""
    out: dict = {}
    kv = targets.get("kvgate", {}).get("results")
    sg = targets.get("sglang-router", {}).get("results")
    if not kv:
        return {"error": "kvgate did not run"}
    multi = {
        name: entry["results"]
        for name, entry in targets.items()
        if name.startswith("kvgate") and entry.get("results")
    }
    for mode in ("non_stream", "stream"):
        m = kv[mode]
        by_workers = {}
        for name, res in multi.items():
            w = {"rps": res[mode]["throughput_rps"], "added_p50_ms": res[mode]["added_p50_ms"]}
            if sg:
                ratio = round(res[mode]["throughput_rps"] / sg[mode]["throughput_rps"], 3)
                w["over_sglang_rps"] = ratio
                w["target_rps_at_least_0_7x_sglang"] = ratio >= 0.7
            by_workers[name] = w
        row = {
            "kvgate_added_p50_ms": m["added_p50_ms"],
            "kvgate_added_p99_ms": m["added_p99_ms"],
            "kvgate_rps": m["throughput_rps"],
            "target_added_p50_under_0_5_ms": m["added_p50_ms"] < 0.5,
        }
        if sg:
            row["sglang_rps"] = sg[mode]["throughput_rps"]
            row["kvgate_over_sglang_rps"] = round(
                m["throughput_rps"] / sg[mode]["throughput_rps"], 3
            )
            row["target_rps_at_least_0_7x_sglang"] = row["kvgate_over_sglang_rps"] >= 0.7
            row["sglang_added_p50_ms"] = sg[mode]["added_p50_ms"]
        vr = targets.get("vllm-router", {}).get("results")
        if vr:
            row["vllm_router_rps"] = vr[mode]["throughput_rps"]
            row["vllm_router_added_p50_ms"] = vr[mode]["added_p50_ms"]
        row["by_workers"] = by_workers
        out[mode] = row
    return out


def _print(result: dict) -> None:
    print(
        f"{'target':<18}{'mode':<12}{'p50 ms':>9}{'p99 ms':>9}{'+p50':>8}{'+p99':>8}"
        f"{'1st B p50':>10}{'req/s':>8}"
    )
    for name, entry in result["targets"].items():
        if "error" in entry:
            print(f"{name:<18}error: {entry['error'][:200]}")
            continue
        for mode, m in entry.get("results", {}).items():
            lat = m["latency_ms"]
            print(
                f"{name:<18}{mode:<12}{lat['p50']:>9.3f}{lat['p99']:>9.3f}"
                f"{m.get('added_p50_ms', 0):>8.3f}{m.get('added_p99_ms', 0):>8.3f}"
                f"{m['first_byte_ms']['p50']:>10.3f}{m['throughput_rps']:>8.0f}"
            )
    print(json.dumps(result.get("summary"), indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb")
    up = sub.add_parser("upstream", help="run the instant upstream (used by the benchmark)")
    up.add_argument("--ports", type=int, nargs="+", required=True)
    up.add_argument("--chunks", type=int, default=8)
    up.add_argument("--gap-ms", type=float, default=1.0)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--chunks", type=int, default=8, help="SSE events per streamed answer")
    p.add_argument("--gap-ms", type=float, default=1.0, help="time between streamed events")
    p.add_argument(
        "--phase-jitter-ms",
        type=float,
        default=1.0,
        help="random pause before each streamed latency request, up to this (0: none)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--latency-requests", type=int, default=400, help="per target, per round")
    p.add_argument("--throughput-requests", type=int, default=1500, help="per target, per round")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--kvgate-policy", default="e2")
    p.add_argument(
        "--access-log",
        action="store_true",
        help="kvgate targets write their access log (to --log-dir) instead of none",
    )
    p.add_argument(
        "--workers",
        type=lambda v: sorted({int(x) for x in v.split(",")}),
        default=[1, 2],
        metavar="N[,N...]",
        help="kvgate targets to run, by `--workers` count (default 1,2; 1 is always run)",
    )
    p.add_argument(
        "--no-busy-poll",
        dest="busy_poll",
        action="store_false",
        help="skip the kvgate-busy-poll target (one worker with --busy-poll)",
    )
    p.add_argument(
        "--broker-url",
        default=None,
        help="Redis for the kvgate targets (default: a private redis-server on loopback)",
    )
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.add_argument("--log-dir", default="/tmp/kvgate-bench-gateway")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--quick", action="store_true", help="a small run (for a smoke test)")
    args = p.parse_args(argv)
    if args.verb == "upstream":
        _run(_serve_upstream(args.ports, args.chunks, args.gap_ms))
        return 0
    if 1 not in args.workers:  # the summary's reference row
        args.workers = [1, *args.workers]
    if any(w < 1 for w in args.workers):
        p.error("--workers counts must be >= 1")
    if args.quick:
        args.rounds, args.latency_requests, args.throughput_requests = 1, 50, 200
    result = _run(run_bench(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    _print(result)
    print(f"saved {out}")
    return 0


def _run(coro):  # uvloop when installed: the same loop the gateway's CLI uses
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    except ImportError:
        return asyncio.run(coro)


if __name__ == "__main__":
    sys.exit(main())
