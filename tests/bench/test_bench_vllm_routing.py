"""The vLLM routing benchmark's parts that need no vLLM: the one-copy hit-rate ceiling and the
simulated replica (``--simulate``)."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest

from bench.bench_vllm_routing import main, one_copy_hit_rate, replica_workload
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
    base = dict(documents=12, doc_tokens=300, requests=300, sim_rate=16.0, engines=3)
    return argparse.Namespace(**(base | kw))


def test_the_replica_sizes_documents_in_the_profiles_tokens_with_zipf_popularity():
    profile = load_profile("vllm-cpu-tiny")
    reqs = replica_workload(_args(), 0, profile)
    assert len(reqs) == 300
    assert all(r.input_tokens == 300 + 15 and r.output_tokens == 8 for r in reqs)
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


def test_simulate_refuses_a_cache_size_the_profile_does_not_have(tmp_path: Path):
    with pytest.raises(SystemExit, match="KV blocks"):
        main(["--simulate", "1", "--kv-blocks", "32", "--out", str(tmp_path / "x.json")])
