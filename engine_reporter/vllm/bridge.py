"""The bridge process next to one vLLM engine: the I/O shell around the pure modules.

Two tasks share one :class:`engine_reporter.Reporter` (which numbers, batches and publishes the
events and keeps the cache mirror for snapshots):

* events: a ZMQ SUB socket on vLLM's KV event endpoint. Each message is decoded
  (:mod:`.wire`), checked against the sequence (:mod:`.sequence`: gaps are filled from vLLM's
  replay socket, a restart resets), translated (:mod:`.translate`) and emitted. At start the
  bridge asks the replay socket for everything vLLM still buffers, so a bridge started after
  vLLM (or restarted) rebuilds the cache view without waiting for new traffic;
* load: every ``metrics_interval_s`` it scrapes vLLM's ``/metrics`` (:mod:`.metrics`) and emits
  a heartbeat when the load changed, or at least every ``heartbeat_interval_s``; ``/v1/models``
  gives the served model names. A changed ``process_start_time_seconds`` is a restart.

A reset (vLLM's AllBlocksCleared, a restart, events lost beyond replay) emits AllCleared and
continues in a new epoch: the reporter is closed and a new one started, whose first snapshot is
the (empty) cache.

Nothing here raises out of a loop: bad messages, HTTP errors and broker trouble are counted,
logged once per kind and per five minutes, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import aiohttp
import zmq
import zmq.asyncio

from broker.base import Broker
from broker.events import AllCleared, Event, LoadHeartbeat
from engine_reporter import Reporter, new_epoch
from engine_reporter.vllm.metrics import (
    MetricsError,
    VllmLoad,
    build_heartbeat,
    decode_figures,
    parse_metrics,
    served_models,
)
from engine_reporter.vllm.sequence import SeqTracker, usable_run
from engine_reporter.vllm.tokens import TokenBytes
from engine_reporter.vllm.translate import Translator
from engine_reporter.vllm.wire import (
    VllmAllCleared,
    VllmBatch,
    VllmMessage,
    WireError,
    decode_message,
    decode_replay_frames,
)
from kvgate.cost_model import DEFAULT_PROFILE, announced_profile, load_profile
from kvgate.logs import LogOnce

log = logging.getLogger("kvgate.bridge.vllm")


@dataclass(frozen=True, slots=True)
class BridgeConfig:
    """One bridge, one vLLM engine (``kvgate bridge vllm --help`` explains each field)."""

    zmq_endpoint: str
    model_dir: Path
    engine_id: str
    engine_url: str
    replay_endpoint: str | None = None
    zmq_bind: bool = False
    topic: str = ""
    profile: str = DEFAULT_PROFILE
    role: str = "both"  # prefill, decode or both: the vLLM's part in a disaggregated fleet
    # vLLM's --max-num-batched-tokens, announced as the most prompt tokens it prefills in one
    # piece (None: not announced; routers then price a prompt's prefill in one piece)
    prefill_chunk_tokens: int | None = None
    models: tuple[str, ...] = ()
    metrics_interval_s: float = 0.2
    heartbeat_interval_s: float = 1.0
    models_interval_s: float = 10.0
    http_timeout_s: float = 2.0
    replay_timeout_s: float = 2.0
    replay_at_start: bool = True
    stats_interval_s: float = 60.0


@dataclass(slots=True)
class BridgeStats:
    """What the bridge saw; logged every ``stats_interval_s`` and read by tests."""

    messages: int = 0
    malformed_messages: int = 0
    skipped_events: int = 0
    vllm_events: int = 0
    kvgate_events: int = 0
    gaps: int = 0
    replay_requests: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    stale_messages: int = 0
    restarts: int = 0
    resets: int = 0
    scrapes: int = 0
    scrape_errors: int = 0
    heartbeats: int = 0
    last_seq: int = -1

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


ReporterFactory = Callable[[str], Reporter]


@dataclass(slots=True)
class _LoadState:
    models: tuple[str, ...] = ()
    models_at: float = -1e18
    last_hb: LoadHeartbeat | None = None
    last_hb_at: float = -1e18
    start_time: float | None = None
    scrape: VllmLoad | None = None  # the previous scrape (its decode counters)
    # When the event stream already showed a restart (sequence back to 0), the new process
    # start time that /metrics reports next is the same restart, not another one: resetting
    # again would wipe what the new process has announced since.
    restart_from_events_at: float | None = None


RESTART_MATCH_S = 30.0  # how long an event-detected restart explains a new start time


class VllmBridge:
    """Mirrors one vLLM engine's prefix cache and load into kvgate's broker."""

    def __init__(
        self,
        config: BridgeConfig,
        broker: Broker,
        *,
        tokens: TokenBytes | None = None,
        reporter_factory: ReporterFactory | None = None,
    ) -> None:
        self.config = config
        self.broker = broker
        self.tokens = tokens or TokenBytes.from_model_dir(config.model_dir)
        self.translator = Translator(self.tokens)
        self.tracker = SeqTracker()
        self.stats = BridgeStats()
        self._make_reporter = reporter_factory or (
            lambda epoch: Reporter(broker, config.engine_id, epoch=epoch)
        )
        self.reporter: Reporter = self._make_reporter(new_epoch())
        profile = load_profile(config.profile)
        self._cost_profile = profile  # (prices the prompt tokens vLLM computed in an interval)
        self._fallback_blocks = profile.kv_blocks
        # a name routers can load, else the profile inline: a file given by path is on this
        # host only
        self._profile_spec = announced_profile(profile)
        self._load = _LoadState(models=config.models)
        self._lock = asyncio.Lock()
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._log_once = LogOnce(log)
        if self.tokens.normalized:
            log.warning(
                "tokenizer of %s has a normalizer: block bytes may differ from the raw prompt",
                config.model_dir,
            )

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start publishing, subscribe, catch up from the replay buffer, start the loops."""
        cfg = self.config
        await self.reporter.start()
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        if cfg.zmq_bind:
            self._sub.bind(cfg.zmq_endpoint)
        else:
            self._sub.connect(cfg.zmq_endpoint)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=cfg.http_timeout_s))
        if cfg.replay_endpoint and cfg.replay_at_start:
            async with self._lock:
                await self._fill(0, None)
        self._tasks = [
            asyncio.create_task(self._events_loop(), name=f"bridge-events:{cfg.engine_id}"),
            asyncio.create_task(self._load_loop(), name=f"bridge-load:{cfg.engine_id}"),
            asyncio.create_task(self._stats_loop(), name=f"bridge-stats:{cfg.engine_id}"),
        ]
        log.info(
            "bridge %s: vLLM events %s%s, replay %s, metrics %s/metrics",
            cfg.engine_id,
            "bind " if cfg.zmq_bind else "",
            cfg.zmq_endpoint,
            cfg.replay_endpoint,
            cfg.engine_url,
        )

    async def close(self) -> None:
        """Stop the loops, flush what was emitted, close sockets (idempotent)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        await self.reporter.close()
        if self._http is not None:
            await self._http.close()
            self._http = None
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ----------------------------------------------------------------- events

    async def _events_loop(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            try:
                async with self._lock:
                    await self.handle_frames(frames)
            except Exception:  # a bug must not end the bridge: log it and go on
                log.exception("bridge %s: message handling failed", self.config.engine_id)

    async def handle_frames(self, frames: list[bytes]) -> None:
        """One message from the PUB socket (caller holds the lock)."""
        self.stats.messages += 1
        try:
            msg = decode_message(frames)
        except WireError as exc:
            self.stats.malformed_messages += 1
            self._log_once.warning("malformed", "bridge: dropped malformed vLLM message: %s", exc)
            return
        verdict = self.tracker.on_message(msg.seq)
        if verdict.kind == "stale":
            self.stats.stale_messages += 1
            return
        if verdict.kind == "restart":
            self.stats.restarts += 1
            log.warning(
                "bridge %s: vLLM sequence went back to %d: engine restarted",
                self.config.engine_id,
                msg.seq,
            )
            self._load.restart_from_events_at = time.monotonic()  # before the await: the
            await self._reset("vLLM restarted")  # metrics task may scrape meanwhile
        if verdict.kind in ("fill", "restart") and msg.seq > 0:
            if self.tracker.expected is not None:
                self.stats.gaps += 1
            await self._fill(verdict.replay_from, msg.seq)
        await self._apply(msg)

    async def _apply(self, msg: VllmMessage) -> None:
        await self._apply_batch(msg.batch)
        self.tracker.applied(msg.seq)
        self.stats.last_seq = msg.seq

    async def _apply_batch(self, batch: VllmBatch) -> None:
        self.stats.skipped_events += batch.skipped
        if batch.skipped:
            self._log_once.warning(
                "skipped", "bridge: skipped %d malformed or unknown vLLM events", batch.skipped
            )
        for ev in batch.events:
            self.stats.vllm_events += 1
            if isinstance(ev, VllmAllCleared):
                await self._reset("vLLM cleared its prefix cache")
                continue
            for out in self.translator.apply(ev):
                self._emit(out)

    def _emit(self, event: Event) -> None:
        self.stats.kvgate_events += 1
        self.reporter.emit(event)

    async def _reset(self, reason: str) -> None:
        """AllCleared, forget every block, continue in a new epoch (caller holds the lock)."""
        self.stats.resets += 1
        log.info("bridge %s: reset (%s): new epoch", self.config.engine_id, reason)
        self.translator.reset()
        self._emit(AllCleared())
        old = self.reporter
        self.reporter = self._make_reporter(new_epoch())
        await old.close(unregister=False)
        await self.reporter.start()
        if self._load.last_hb is not None:
            self.reporter.emit(self._load.last_hb)

    # ----------------------------------------------------------------- replay

    async def _fill(self, start: int, until: int | None) -> None:
        """Apply batches ``[start, until)`` from vLLM's replay buffer (``until`` None: all it
        has). Events lost beyond the buffer mid-stream make the view unreliable: reset."""
        fresh = self.tracker.expected is None
        got = await self._request_replay(start)
        if got is None:
            replayed: dict[int, VllmMessage] = {}
        else:
            replayed = {m.seq: m for m in got}
        run, complete = usable_run(replayed, start, until)
        if not complete:
            if fresh:
                if until is not None or run:
                    log.info(
                        "bridge %s: vLLM history before seq %d is gone; blocks cached before "
                        "then stay unknown until vLLM stores them again",
                        self.config.engine_id,
                        run[0] if run else until,
                    )
            else:
                self.stats.replay_failures += 1
                log.warning(
                    "bridge %s: could not replay vLLM batches %d..%s: resetting",
                    self.config.engine_id,
                    start,
                    "" if until is None else until - 1,
                )
                await self._reset("events lost beyond replay")
                self.tracker.reset()
        for seq in run:
            await self._apply(replayed[seq])
        self.stats.replayed_batches += len(run)
        if run:
            self.tracker.replayed(run[0], run[-1])

    async def _request_replay(self, start: int) -> list[VllmMessage] | None:
        """Everything vLLM's replay socket returns from ``start`` on; None if it did not
        answer in time (the socket is then rebuilt, so a late answer cannot leak into the next
        request)."""
        endpoint = self.config.replay_endpoint
        if not endpoint or self._ctx is None:
            return None
        self.stats.replay_requests += 1
        if self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(endpoint)
        sock = self._replay
        out: list[VllmMessage] = []
        deadline = time.monotonic() + self.config.replay_timeout_s
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000) + 1):
                    raise TimeoutError
                frames = await sock.recv_multipart()
                try:
                    msg = decode_replay_frames(frames)
                except WireError as exc:
                    self.stats.malformed_messages += 1
                    self._log_once.warning("replay", "bridge: bad replay frame: %s", exc)
                    continue
                if msg is None:
                    return out
                out.append(msg)
        except (TimeoutError, zmq.ZMQError) as exc:
            self._log_once.warning(
                "replay-timeout",
                "bridge %s: vLLM replay socket %s did not answer (%s)",
                self.config.engine_id,
                endpoint,
                type(exc).__name__,
            )
            sock.close(linger=0)
            self._replay = None
            return None

    # ----------------------------------------------------------------- load

    async def _load_loop(self) -> None:
        interval = self.config.metrics_interval_s
        while True:
            started = time.monotonic()
            try:
                await self.poll_load()
            except Exception:
                log.exception("bridge %s: load poll failed", self.config.engine_id)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def poll_load(self) -> LoadHeartbeat | None:
        """One scrape; emits a heartbeat when due and returns it."""
        assert self._http is not None
        cfg = self.config
        base = cfg.engine_url.rstrip("/")
        now = time.monotonic()
        try:
            async with self._http.get(f"{base}/metrics") as resp:
                resp.raise_for_status()
                text = await resp.text()
            load = parse_metrics(text)
            if not cfg.models and now - self._load.models_at >= cfg.models_interval_s:
                async with self._http.get(f"{base}/v1/models") as resp:
                    resp.raise_for_status()
                    self._load.models = served_models(await resp.json(content_type=None))
                self._load.models_at = now
        except (aiohttp.ClientError, TimeoutError, MetricsError, ValueError) as exc:
            self.stats.scrape_errors += 1
            self._log_once.warning(
                "scrape", "bridge %s: cannot read %s: %s", cfg.engine_id, base, exc
            )
            return None
        self.stats.scrapes += 1
        previous_start = self._load.start_time
        if load.process_start_time is not None:
            self._load.start_time = load.process_start_time
        if previous_start is not None and load.process_start_time not in (None, previous_start):
            seen_at = self._load.restart_from_events_at
            self._load.restart_from_events_at = None
            if seen_at is None or time.monotonic() - seen_at > RESTART_MATCH_S:
                self.stats.restarts += 1
                log.warning("bridge %s: vLLM process restarted", cfg.engine_id)
                async with self._lock:
                    await self._reset("vLLM process restarted")
                    self.tracker.reset()
        decode = decode_figures(load, self._load.scrape, self._cost_profile)
        self._load.scrape = load
        hb = build_heartbeat(
            load,
            url=base,
            models=self._load.models,
            profile=self._profile_spec,
            fallback_blocks=self._fallback_blocks,
            role=cfg.role,
            decode=decode,
            prefill_chunk_tokens=cfg.prefill_chunk_tokens,
        )
        last = self._load.last_hb
        if last is None or last != hb or now - self._load.last_hb_at >= cfg.heartbeat_interval_s:
            self._load.last_hb = hb
            self._load.last_hb_at = now
            self.stats.heartbeats += 1
            self.reporter.emit(hb)
        return hb

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            log.info(
                "bridge %s stats",
                self.config.engine_id,
                extra={
                    "bridge": self.stats.as_dict(),
                    "translate": self.translator.stats.as_dict(),
                    "held_blocks": self.translator.held_blocks,
                },
            )
