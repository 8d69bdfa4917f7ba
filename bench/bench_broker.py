"""Broker throughput: publish rate of one Reporter and ingest rate of one Consumer, on real Redis.

    .venv/bin/python -m bench.bench_broker [--url redis://127.0.0.1:6379/0] [--events 200000]

Events are realistic KV announcements of an engine whose cache is full (32768 blocks): BlockStored
chains of 4-16 blocks of 64 bytes, and BlockRemoved events of 16 hashes evicting as many blocks as
were stored (:func:`make_events`), generated before timing starts.

* publish: ``emit`` every event (yielding to the loop every ``--yield-every`` emits so the
  flusher runs) until ``flush()`` confirms all reached Redis; events/s of the whole run;
* ingest: a fresh Consumer with a trivial counting sink reads the whole stream from its start
  (decode + dispatch); block events/s (BlockStored + BlockRemoved events) and blocks/s (blocks
  stored, i.e. per-block KV announcements).

Both run in this one Python process, one at a time, so each uses a single core (Redis runs in its
own process). Keys live under a unique prefix and are deleted afterwards. Results go to
``results/broker.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from pathlib import Path

import broker
from broker.consumer import Consumer
from broker.events import KV_EVENT_TYPES, BlockRemoved, BlockStored, Envelope
from engine_reporter import Reporter
from engine_reporter.hashing import chain_hashes

RESULTS = Path("results/broker.json")


def make_events(n: int, seed: int, block_bytes: int, cache_blocks: int = 32768) -> list:
    """A steady-state engine cache of ``cache_blocks`` blocks: each miss stores a chain of 4-16
    blocks (half of them extending a cached prefix), and once full the oldest blocks are evicted
    in BlockRemoved events of up to 16 hashes, so stores and removals balance."""
    rng = random.Random(seed)
    out: list = []
    cached: dict[int, None] = {}
    recent: list[int] = []
    while len(out) < n:
        if len(cached) > cache_blocks:
            victims = []
            for h in cached:
                victims.append(h)
                if len(victims) == 16:
                    break
            for h in victims:
                del cached[h]
            out.append(BlockRemoved(tuple(victims)))
            continue
        blocks = tuple(rng.randbytes(block_bytes) for _ in range(rng.randint(4, 16)))
        parent = recent[-1] if recent and rng.random() < 0.5 else None
        hashes = tuple(chain_hashes(parent, blocks))
        cached.update(dict.fromkeys(hashes))
        recent.extend(hashes)
        del recent[:-64]
        out.append(BlockStored(parent, hashes, blocks))
    return out


class CountingSink:
    """The trivial sink: counts what it is handed."""

    def __init__(self) -> None:
        self.events = 0
        self.block_events = 0

    def apply(self, env: Envelope, now: float) -> None:
        self.events += 1
        if type(env.event) in KV_EVENT_TYPES:
            self.block_events += 1

    def reset_engine(self, engine_id: str, now: float) -> None:
        pass


async def bench_publish(b, events: list, args) -> dict:
    rep = Reporter(
        b,
        "bench-engine",
        entry_events=args.entry_events,
        buffer_size=max(65536, args.yield_every * 4),
        maxlen=0,
        snapshot_interval_s=3600,
    )
    await rep.start()
    wall, cpu = time.perf_counter(), time.process_time()
    for i, ev in enumerate(events):
        rep.emit(ev)
        if i % args.yield_every == 0:
            await asyncio.sleep(0)
    flushed = await rep.flush(timeout_s=120)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    result = {
        "events": len(events),
        "seconds": round(wall, 4),
        "cpu_seconds": round(cpu, 4),
        "events_per_s": round(len(events) / wall),
        "events_per_cpu_s": round(len(events) / cpu),
        "entries": rep.stats.entries,
        "dropped": rep.dropped,
        "flushed": flushed,
    }
    await rep.close(unregister=False)
    return result


async def bench_ingest(b, n_events: int, args) -> dict:
    sink = CountingSink()
    consumer = Consumer(b, sink, count=args.read_count, discover_interval_s=3600)
    await consumer.discover()  # registry lookup and snapshot load, outside the timing
    wall, cpu = time.perf_counter(), time.process_time()
    while sink.events < n_events:
        if not await consumer.poll_once():
            break
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "events": sink.events,
        "block_events": sink.block_events,
        "blocks": consumer.stats.blocks,
        "seconds": round(wall, 4),
        "cpu_seconds": round(cpu, 4),
        "events_per_s": round(sink.events / wall),
        "block_events_per_s": round(sink.block_events / wall),
        "block_events_per_cpu_s": round(sink.block_events / cpu),
        "blocks_per_s": round(consumer.stats.blocks / wall),
        "blocks_per_cpu_s": round(consumer.stats.blocks / cpu),
        "malformed": consumer.stats.malformed,
        "resyncs": consumer.stats.resyncs,
        "complete": sink.events == n_events,
    }


async def run_one(url: str, args, events: list) -> dict:
    prefix = f"kvgate-bench:{os.getpid()}:{time.monotonic_ns()}:"
    b = await broker.connect(url, prefix=prefix)
    try:
        publish = await bench_publish(b, events, args)
        ingest = await bench_ingest(b, len(events), args)
    finally:
        await cleanup(b, url, prefix)
        await b.close()
    return {"publish": publish, "ingest": ingest}


async def cleanup(b, url: str, prefix: str) -> None:
    if not url.startswith("redis"):
        return
    import redis.asyncio as aioredis  # only to delete the benchmark's keys

    raw = aioredis.Redis.from_url(url)
    keys = [k async for k in raw.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await raw.delete(*keys)
    await raw.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--block-bytes", type=int, default=64)
    parser.add_argument("--entry-events", type=int, default=256, help="events per stream entry")
    parser.add_argument("--read-count", type=int, default=64, help="entries per stream per read")
    parser.add_argument("--yield-every", type=int, default=512, help="emits between loop yields")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the best is reported")
    parser.add_argument("--memory", action="store_true", help="also run on the embedded broker")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    events = make_events(args.events, 1, args.block_bytes)
    runner = asyncio.run
    if args.uvloop:
        import uvloop

        runner = uvloop.run
    urls = [args.url] + (["memory://"] if args.memory else [])
    results = {}
    for url in urls:
        runs = [runner(run_one(url, args, events)) for _ in range(args.repeat)]
        best = {
            "publish": max((r["publish"] for r in runs), key=lambda r: r["events_per_s"]),
            "ingest": max((r["ingest"] for r in runs), key=lambda r: r["block_events_per_s"]),
            "publish_events_per_s_all": [r["publish"]["events_per_s"] for r in runs],
            "ingest_block_events_per_s_all": [r["ingest"]["block_events_per_s"] for r in runs],
        }
        results["redis" if url.startswith("redis") else "memory"] = best
        print(
            f"{url}: publish {best['publish']['events_per_s']:,} events/s "
            f"({best['publish']['events_per_cpu_s']:,} per CPU second; "
            f"runs {best['publish_events_per_s_all']}), ingest "
            f"{best['ingest']['block_events_per_s']:,} block events/s "
            f"({best['ingest']['block_events_per_cpu_s']:,} per CPU second), "
            f"{best['ingest']['blocks_per_s']:,} blocks/s "
            f"(runs {best['ingest_block_events_per_s_all']})"
        )
    out = {
        "benchmark": "broker",
        "workload": {
            "events": args.events,
            "block_store_chain_blocks": "4-16 (uniform)",
            "block_bytes": args.block_bytes,
            "engine_cache_blocks": 32768,
            "block_removed": "16 hashes each, evicting as many blocks as stored (steady state)",
            "entry_events": args.entry_events,
            "read_count_entries": args.read_count,
            "yield_every_emits": args.yield_every,
            "event_loop": "uvloop" if args.uvloop else "asyncio",
        },
        "targets": {"publish_events_per_s": 100_000, "ingest_block_events_per_s": 200_000},
        "results": results,
        "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "load_average_1m": round(os.getloadavg()[0], 2),
        "note": "single Python process, one core; best of --repeat runs; *_per_cpu_s divide by"
        " the process's CPU time, the fair figure on a shared, overloaded machine",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
