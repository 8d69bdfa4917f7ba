"""Live replay: send a workload open-loop to any OpenAI-compatible server and time every request.

Works against kvgate's gateway, sglang-router, vllm-router or a bare engine: requests go to
``{base_url}/v1/completions`` or ``/v1/chat/completions`` at their arrival times whether or not
earlier ones have finished (open loop; a conversation's turn that resends an earlier turn's
answer, ``Request.after``, waits for that answer and then the turns' gap), streamed, with SLO
headers (``x-kvgate-ttft-ms``, ``x-kvgate-tpot-ms``) and, unless turned off, the trace's token
counts in the body field ``kvgate`` (kvgate engines honour it; other servers ignore or reject
unknown fields, hence the flag). Every request yields a :class:`bench.metrics.RequestRecord`;
the run writes them as JSONL and a summary JSON.

Bounded by construction: at most ``max_requests`` requests, none sent after ``max_duration_s``,
a per-request timeout, and a final drain timeout after which what is still open is cancelled
and recorded as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from bench.metrics import STATUS_OK, STATUS_TRANSPORT, RequestRecord, summarize, write_records
from bench.workloads import Request
from kvgate.stats import percentile

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """What to send where, and the bounds of the run."""

    base_url: str
    model: str | None = None  # override every request's model
    stream: bool = True
    send_hint: bool = True  # body field kvgate: {input_tokens, output_tokens}
    ignore_eos: bool = True
    slo_headers: bool = True
    max_requests: int | None = None
    max_duration_s: float | None = None  # stop sending after this many seconds
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 120.0
    max_inflight: int = 4096  # beyond this, a request is recorded as dropped by the client
    api_key: str | None = None
    progress: bool = True


@dataclass(slots=True)
class ReplayResult:
    """Every record, the summary, and how the client kept up with the schedule."""

    records: list[RequestRecord]
    summary: dict

    def write(self, jsonl_path: Path | None, summary_path: Path | None) -> None:
        if jsonl_path is not None:
            write_records(jsonl_path, self.records)
        if summary_path is not None:
            summary_path.parent.mkdir(parents=True, exist_ok=True)
            summary_path.write_bytes(orjson.dumps(self.summary, option=orjson.OPT_INDENT_2))


def route_field(headers: Mapping[str, str], name: str) -> str | None:
    """One field (``engine``, ``reason``, ...) of kvgate's ``x-kvgate-route`` response header."""
    route = headers.get("x-kvgate-route")
    if route:
        for part in route.split(";"):
            key, _, value = part.partition("=")
            if key.strip() == name and value and value != "-":
                return value
    return None


def engine_from_headers(headers: Mapping[str, str]) -> str | None:
    """The engine that served a response: kvgate's route header, else ``x-kvgate-engine``."""
    return route_field(headers, "engine") or headers.get("x-kvgate-engine")


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or ()
    if not choices:
        return ""
    c0 = choices[0]
    if "text" in c0:
        return c0.get("text") or ""
    delta = c0.get("delta") or {}
    return delta.get("content") or ""


def _message_text(payload: dict) -> str:
    """A unary chat answer's text."""
    choices = payload.get("choices") or ()
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    message = first.get("message")
    return (message.get("content") or "") if isinstance(message, dict) else ""


def _resend_answers(body: dict, answers: list[str]) -> None:
    """Put the answers a conversation's earlier turns got in place of its assistant messages,
    in order (the workload's own text where there is none)."""
    replies = [m for m in body.get("messages") or () if m.get("role") == "assistant"]
    for message, answer in zip(replies, answers, strict=False):
        if answer:
            message["content"] = answer


def _apply_usage(rec: RequestRecord, usage: dict | None) -> None:
    if not isinstance(usage, dict):
        return
    rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
    rec.completion_tokens = int(usage.get("completion_tokens") or rec.completion_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        rec.cached_tokens = int(details["cached_tokens"])


def _error_text(raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
        msg = body.get("error", {}).get("message") if isinstance(body, dict) else None
        if msg:
            return str(msg)[:300]
    except orjson.JSONDecodeError:
        pass
    return raw[:300].decode("utf-8", "replace")


async def send_one(
    session: aiohttp.ClientSession,
    req: Request,
    cfg: ReplayConfig,
    scheduled: float,
    clock: Callable[[], float],
    answers: list[str] | None = None,
) -> RequestRecord:
    """Send one request and time it; never raises (errors become the record's status/error).

    ``scheduled`` is the clock value the request was due at: TTFT and e2e count from it, so
    a client falling behind shows up as latency rather than hiding it. ``answers``, for a
    conversation's turn: the answers its earlier turns got, which it resends as its assistant
    messages in their place (as a client resends what it got); this one's answer is appended.
    """
    rec = RequestRecord.for_request(req, prompt_tokens=req.input_tokens)
    body = req.body(
        model=cfg.model, stream=cfg.stream, hint=cfg.send_hint, ignore_eos=cfg.ignore_eos
    )
    if answers is not None:
        _resend_answers(body, answers)
    text: list[str] = []
    headers = {"content-type": "application/json", "x-request-id": req.request_id}
    if cfg.slo_headers:
        headers.update(req.headers())
    if cfg.api_key:
        headers["authorization"] = f"Bearer {cfg.api_key}"
    url = cfg.base_url.rstrip("/") + req.path()
    first: float | None = None
    last: float | None = None
    chunks = 0
    try:
        async with session.post(
            url,
            data=orjson.dumps(body),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s),
        ) as resp:
            rec.status = resp.status
            rec.engine = engine_from_headers(resp.headers)
            rec.reason = route_field(resp.headers, "reason")
            if resp.status != 200:
                rec.error = _error_text(await resp.read())
                rec.e2e_s = clock() - scheduled
                return rec
            if not cfg.stream:
                payload = orjson.loads(await resp.read())
                rec.e2e_s = clock() - scheduled
                _apply_usage(rec, payload.get("usage"))
                text.append(_message_text(payload))
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:300]
                    break
                piece = _chunk_text(chunk)
                if piece:
                    text.append(piece)
                    now = clock()
                    if first is None:
                        first = now
                    elif last is not None:
                        gap = now - last
                        if rec.max_gap_s is None or gap > rec.max_gap_s:
                            rec.max_gap_s = gap
                    last = now
                    chunks += 1
                _apply_usage(rec, chunk.get("usage"))
            rec.e2e_s = clock() - scheduled
    except asyncio.CancelledError:
        rec.error = "cancelled (drain timeout)"
        rec.e2e_s = clock() - scheduled
        raise
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError) as exc:
        if rec.status == STATUS_OK:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        else:
            rec.status = STATUS_TRANSPORT
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.e2e_s = clock() - scheduled
        return rec
    finally:
        if answers is not None:  # (one entry a turn, empty when it got none)
            answers.append("".join(text) if rec.ok else "")
        if first is not None:
            rec.ttft_s = first - scheduled
            tokens = max(rec.completion_tokens, chunks)
            rec.completion_tokens = tokens
            if tokens > 1 and last is not None:
                rec.tpot_s = (last - first) / (tokens - 1)
    if first is None and rec.error is None:
        rec.error = "no tokens in the stream"
    return rec


class _Progress:
    """tqdm when installed (and wanted), else a plain line every few seconds on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self._bar = None
        self._last_print = 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self._bar = None

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            return
        now = time.monotonic()
        if now - self._last_print >= 5.0 or self.done == self.total:
            self._last_print = now
            print(f"replay: {self.done}/{self.total} done", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _dropped(req: Request, why: str) -> RequestRecord:
    return RequestRecord.for_request(req, error=why)


async def replay(requests: Sequence[Request], cfg: ReplayConfig) -> ReplayResult:
    """Replay ``requests`` open-loop against ``cfg.base_url``; see the module docstring."""
    reqs = list(requests[: cfg.max_requests] if cfg.max_requests is not None else requests)
    if cfg.max_duration_s is not None:
        t0_trace = reqs[0].arrival if reqs else 0.0
        reqs = [r for r in reqs if r.arrival - t0_trace < cfg.max_duration_s]
    loop = asyncio.get_running_loop()
    clock = loop.time
    progress = _Progress(len(reqs), cfg.progress)
    records: list[RequestRecord] = []
    tasks: set[asyncio.Task] = set()
    send_lag: list[float] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    wall_start = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector) as session:
        start = clock()
        base = reqs[0].arrival if reqs else 0.0
        # conversations (Request.after): the arrival of each request a later turn waits for,
        # its task and when it ended, and the answers each conversation got, in order (its
        # next turns resend them); nothing for a workload without conversations
        awaited = {r.after for r in reqs if r.after is not None}
        arrival = {r.request_id: r.arrival for r in reqs if r.request_id in awaited}
        turns: dict[str, asyncio.Task] = {}
        ended: dict[str, float] = {}
        got: dict[str, list[str]] = {}

        def done(task: asyncio.Task) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is None:
                rec = task.result()
                if rec.request_id in awaited:
                    ended[rec.request_id] = clock()
                records.append(rec)
                progress.update(rec)

        async def after_answer(
            before: asyncio.Task, req: Request, due: float, answers: list[str] | None
        ) -> RequestRecord:
            """A turn that resends the answer before it: sent when that answer has ended and
            the gap between the two turns in the workload has passed (its latencies count
            from then), as the simulator sends it."""
            await asyncio.wait({before})
            gap = req.arrival - arrival[req.after or ""]
            sent = max(due, ended.get(req.after or "", clock()) + gap)
            if sent > clock():
                await asyncio.sleep(sent - clock())
            return await send_one(session, req, cfg, sent, clock, answers)

        for req in reqs:
            due = start + (req.arrival - base)
            delay = due - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            send_lag.append(max(clock() - due, 0.0))
            if len(tasks) >= cfg.max_inflight:
                rec = _dropped(req, f"dropped: {cfg.max_inflight} requests already in flight")
                records.append(rec)
                progress.update(rec)
                continue
            before = turns.get(req.after) if req.after is not None else None
            # the answers its conversation got so far, shared by its turns (for its first turn
            # in this replay, a new list, its earlier turns' answers unknown: their text stays)
            answers = got.get(req.after or "") if before is not None else None
            if answers is None and req.reply is not None:
                answers = [""] * sum(1 for t in req.turns if t.role == "assistant")
            if before is not None:
                task = asyncio.ensure_future(after_answer(before, req, due, answers))
            else:
                task = asyncio.ensure_future(send_one(session, req, cfg, due, clock, answers))
            if req.request_id in awaited:
                turns[req.request_id] = task
                if answers is not None:
                    got[req.request_id] = answers
            tasks.add(task)
            task.add_done_callback(done)
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=cfg.drain_timeout_s)
            for t in pending:
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*pending, return_exceptions=True)
            if pending:
                sent = {r.request_id for r in records}
                for req in reqs:
                    if req.request_id not in sent:
                        rec = _dropped(req, "cancelled: still open at the drain timeout")
                        records.append(rec)
                        progress.update(rec)
    progress.close()
    order = {r.request_id: i for i, r in enumerate(reqs)}
    records.sort(key=lambda r: order.get(r.request_id, 0))
    summary = summarize(records)
    summary["target"] = cfg.base_url
    summary["wall_s"] = round(time.perf_counter() - wall_start, 3)
    summary["client_send_lag_ms"] = {
        "p50": round(_q(send_lag, 0.5) * 1000, 3),
        "p99": round(_q(send_lag, 0.99) * 1000, 3),
        "max": round(max(send_lag, default=0.0) * 1000, 3),
    }
    return ReplayResult(records, summary)


def _q(values: list[float], q: float) -> float:
    return percentile(values, q) if values else 0.0
