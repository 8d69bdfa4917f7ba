"""The vLLM routing benchmark's parts that need no vLLM: the one-copy hit-rate ceiling, the
simulated replica (``--simulate``) and a live run's measurements against a vLLM stand-in."""

from __future__ import annotations

import argparse
import http.server
import itertools
import json
import threading
import time
from pathlib import Path

import pytest

from bench.bench_vllm_routing import (
    QUESTION_TOKENS,
    Engine,
    drop_keys,
    main,
    one_copy_hit_rate,
    replica_workload,
    router_view,
    run_once,
    verdict,
)
from bench.sim.runner import SimConfig, run_one
from kvgate.cost_model import load_profile


def test_the_one_copy_ceiling_counts_whole_blocks_of_earlier_prompts_only():
    doc = list(range(100))  # 3 whole blocks of 32 and 4 tokens
    first = [*doc, 1000, 1001]
    second = [*doc, 2000]
    other = [5000 + i for i in range(40)]
    # the first and the unrelated prompt miss; the second finds the document's 3 whole blocks
    got = one_copy_hit_rate([first, second, other], 32)
    assert got == pytest.approx(96 / (102 + 101 + 40))
    # a prompt identical to an earlier one still computes its last token: not its last block
    assert one_copy_hit_rate([doc[:64], doc[:64]], 32) == pytest.approx(32 / 128)


def _args(**kw) -> argparse.Namespace:
    base = dict(
        documents=12, doc_tokens=300, requests=300, sim_rate=16.0, engines=3, sim_concurrency=0
    )
    return argparse.Namespace(**(base | kw))


def test_the_replica_sizes_documents_in_the_profiles_tokens_with_zipf_popularity():
    profile = load_profile("vllm-cpu-tiny")
    reqs = replica_workload(_args(), 0, profile)
    assert len(reqs) == 300
    assert all(r.input_tokens == 300 + QUESTION_TOKENS and r.output_tokens == 8 for r in reqs)
    seg = reqs[0].turns[0].segments[0]
    assert seg.n_bytes == 300 * profile.bytes_per_token  # 300 of the profile's tokens
    docs = [r.turns[0].segments[0].seed for r in reqs]
    counts = sorted((docs.count(d) for d in set(docs)), reverse=True)
    assert len(counts) <= 12 and counts[0] > 2 * counts[len(counts) // 2]  # Zipf: one dominates
    assert all(b.arrival > a.arrival for a, b in itertools.pairwise(reqs))
    assert replica_workload(_args(), 1, profile) != reqs  # seeded


def test_simulate_runs_each_router_over_the_seeds_and_saves_the_figures(tmp_path: Path):
    out = tmp_path / "replica.json"
    argv = ["--simulate", "3", "--requests", "120", "--routers", "e2,round_robin", "--out"]
    assert main([*argv, str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"e2", "round_robin"}
    for _router, runs in doc["runs"].items():
        assert [r["seed"] for r in runs] == [0, 1, 2]
        assert all(sum(r["requests_per_engine"].values()) == 120 for r in runs)
    rr, e2 = doc["summary"]["round_robin"], doc["summary"]["e2"]
    assert rr["max_engine_share_max"] == pytest.approx(40 / 120, abs=1e-3)  # exactly even
    assert e2["hit_rate_mean"] > rr["hit_rate_mean"] + 0.1  # e2 keeps documents together
    v = doc["verdict"]  # issue 17's targets, e2 (the first router) against the best other
    assert v["subject"] == "e2" and v["best_other"] == "round_robin"
    assert v["at_least_best"] and v["hit_rate_diff"] > 0.1


def _runs(*rows: tuple[float, float]) -> list[dict]:
    return [{"hit_rate": h, "max_engine_share": s} for h, s in rows]


def test_the_verdict_judges_the_first_router_against_the_best_other():
    runs = {
        "e2": _runs((0.850, 0.40), (0.846, 0.44), (0.852, 0.46)),
        "cache_aware": _runs((0.851, 0.50), (0.853, 0.55), (0.849, 0.40)),
        "round_robin": _runs((0.60, 0.34), (0.61, 0.34), (0.59, 0.34)),
    }
    v = verdict(runs, paired=False)
    assert v["best_other"] == "cache_aware"
    assert v["hit_rate_diff"] == pytest.approx(-0.0017, abs=1e-4)
    assert not v["at_least_best"]
    assert v["spread"] == pytest.approx(0.006) and v["spread_ok"]
    assert v["runs_over_45_percent"] == 1 and not v["balanced"]
    # two independent samples: the standard errors of the two means combined
    assert v["hit_rate_diff_se"] == pytest.approx(0.0021, abs=1e-4)
    # paired (run k of each router on one workload): the SE of the per-run differences
    paired = verdict(runs, paired=True)
    assert paired["hit_rate_diff_se"] == pytest.approx(0.0029, abs=1e-4)
    runs["e2"] = _runs((0.87, 0.40), (0.84, 0.44), (0.86, 0.45))
    v = verdict(runs, paired=False)
    assert v["at_least_best"] and not v["spread_ok"] and v["balanced"]
    assert verdict({"e2": runs["e2"]}, paired=False) is None


def test_simulate_sizes_the_engines_caches_as_kv_blocks_says(tmp_path: Path):
    """--kv-blocks sizes the replica's caches as it sizes the live engines': 12 documents of
    ~300 tokens on 3 engines fit in 64 blocks of 32 tokens a few at a time, in 16 hardly."""
    rates = {}
    for blocks in (16, 64):
        out = tmp_path / f"kv{blocks}.json"
        argv = ["--simulate", "2", "--requests", "150", "--routers", "e2", "--kv-blocks"]
        assert main([*argv, str(blocks), "--out", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["config"]["kv_blocks"] == blocks
        rates[blocks] = doc["summary"]["e2"]["hit_rate_mean"]
    assert rates[16] < rates[64] - 0.1


class _FakeVllm(http.server.BaseHTTPRequestHandler):
    """A vLLM stand-in for :func:`run_once`: completions (streamed after a pause before the
    first token, or whole), and the three counters the benchmark reads from ``/metrics``, each
    completion counted as 10 prompt tokens of which 4 hit the prefix cache."""

    served = 0
    first_token_s = 0.05

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        n = type(self).served
        if self.path == "/admin/router":  # the gateway's view of its embedded router
            state = {"engines": [{"engine_id": "v0", "routed_total": n, "window_ms": 8.0 * n,
                                  "tpot_ms": 2.5, "inflight": 0}]}  # fmt: skip
            text = json.dumps(state).encode()
            self.send_response(200 if self.headers.get("authorization") else 401)
            self.send_header("content-length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
            return
        text = (
            'vllm:num_requests_running{engine="0"} 0.0\n'  # as every vLLM exports
            f'vllm:prefix_cache_queries_total{{engine="0"}} {10.0 * n}\n'
            f'vllm:prefix_cache_hits_total{{engine="0"}} {4.0 * n}\n'
            f'vllm:request_success_total{{finished_reason="length"}} {float(n)}\n'
        ).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).served += 1
        self.send_response(200)
        self.send_header("x-kvgate-route", "policy=e2;reason=exploit;engine=v0;matched=0")
        if body.get("stream"):
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            time.sleep(self.first_token_s)
            self.wfile.write(b'data: {"choices":[{"text":"a"}]}\n\n')
            self.wfile.flush()
            time.sleep(self.first_token_s)
            self.wfile.write(b"data: [DONE]\n\n")
        else:
            out = b'{"choices":[{"text":"a"}]}'
            time.sleep(self.first_token_s)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        self.close_connection = True


@pytest.mark.parametrize("stream", [False, True])
def test_a_live_run_measures_hits_shares_and_what_the_client_waited(stream: bool):
    _FakeVllm.served = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        engine = Engine("v0", url, "", "", None)  # type: ignore[arg-type]
        args = argparse.Namespace(stream=stream, concurrency=2)
        got = run_once(url, ["a prompt"] * 6, [engine], args)
        view = router_view(url)
    finally:
        server.shutdown()
        server.server_close()
    assert got["errors"] == 0 and got["requests_per_engine"] == {"v0": 6}
    assert got["hit_rate"] == pytest.approx(0.4)
    assert got["hit_rate_per_engine"] == {"v0": pytest.approx(0.4)}
    # the router's view at the end of the run: the fields kept, absent ones as None
    assert view == {
        "v0": {"routed_total": 6, "window_ms": 48.0, "window_prefill_ms": None,
               "window_out_tokens": None, "window_requests": None, "tpot_ms": 2.5, "speed": None}
    }  # fmt: skip
    assert got["routes"] == ["policy=e2;reason=exploit;engine=v0;matched=0"] * 6
    lat = got["latency_ms"]
    assert lat["p50"] >= 1e3 * _FakeVllm.first_token_s and lat["p99"] >= lat["p50"]
    if stream:  # the first token comes one pause before the end of the answer
        ttft = got["ttft_ms"]
        assert 1e3 * _FakeVllm.first_token_s <= ttft["p50"] < lat["p50"]
    else:
        assert got["ttft_ms"] is None


def test_a_runs_redis_keys_are_deleted_after_it_and_no_others(redis_url: str, redis_prefix: str):
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        run, other = f"{redis_prefix}run:", f"{redis_prefix}other:"
        for key in (f"{run}s:v0", f"{run}s:v1", f"{other}s:v0"):
            client.xadd(key, {"k": "v"})
        client.set(f"{run}snap:v0", b"x")
        drop_keys(redis_url, run)
        assert sorted(client.scan_iter(match=f"{redis_prefix}*")) == [f"{other}s:v0".encode()]
        client.delete(f"{other}s:v0")
    finally:
        client.close()
    # an unreachable Redis is reported, not raised: the run's figures are already taken
    drop_keys("redis://127.0.0.1:1/0", run)


def test_the_closed_loop_replica_sends_each_request_when_the_one_a_client_sent_before_ends():
    """--sim-concurrency N: the live run's N clients, not Poisson arrivals. The first N
    requests start together (the first documents' first requests meet idle and busy engines
    as they do live), and request i waits for the answer to request i - N."""
    profile = load_profile("vllm-cpu-tiny")
    poisson = replica_workload(_args(), 0, profile)
    closed = replica_workload(_args(sim_concurrency=4), 0, profile)
    assert [r.turns for r in closed] == [r.turns for r in poisson]  # the same documents
    assert all(r.arrival == 0.0 for r in closed)
    assert [r.after for r in closed[:4]] == [None] * 4
    assert [r.after for r in closed[4:7]] == [r.request_id for r in closed[:3]]


def test_simulate_with_clients_keeps_at_most_that_many_requests_open(tmp_path: Path):
    profile = load_profile("vllm-cpu-tiny")
    reqs = replica_workload(_args(requests=60, sim_concurrency=3), 0, profile)
    records: list = []
    cfg = SimConfig(engines=3, profile="vllm-cpu-tiny", seed=0)
    run_one(reqs, "round_robin", "fcfs", cfg, records=records)
    assert len(records) == 60 and all(r.ok for r in records)
    edges = sorted([(r.arrival, 1) for r in records] + [(r.arrival + r.e2e_s, -1) for r in records])
    open_now = peak = 0
    for _, step in edges:  # (an end at the instant of the next send counts first)
        open_now += step
        peak = max(peak, open_now)
    assert peak == 3  # three clients, each with one request open at a time
    out = tmp_path / "closed.json"
    argv = ["--simulate", "1", "--requests", "30", "--routers", "round_robin", "--out", str(out)]
    assert main([*argv, "--sim-concurrency", "2"]) == 0
    assert main([*argv, "--sim-concurrency", "-1"]) == 2
