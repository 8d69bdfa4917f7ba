"""The scheduler benchmark's speed probe (``--slo-per-speed``): it measures how much slower than
the cost profile the engines answer, with unique prompts of the probe's sizes, on every engine."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.bench_vllm_sched import PROBE_REPS, PROBE_TOKENS, measure_slowdown
from kvgate.cost_model import load_profile

PROFILE = load_profile("vllm-cpu-small").slowed(0.1)  # 2,000 tokens in about 50 ms
SLOWER = 3.0


class _Engine(BaseHTTPRequestHandler):
    """Answers a completion after ``SLOWER`` x the profile's prefill time of its prompt."""

    prompts: list[tuple[int, ...]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompt = tuple(body["prompt"])
        type(self).prompts.append(prompt)
        time.sleep(SLOWER * PROFILE.prefill_ms(len(prompt)) / 1000.0)
        out = json.dumps({"choices": [{"text": "x"}]}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engines() -> Iterator[list[str]]:
    _Engine.prompts = []
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Engine) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_the_probe_finds_how_much_slower_than_the_profile_the_engines_answer(
    engines: list[str],
) -> None:
    found = measure_slowdown(engines, PROFILE)
    # the HTTP round trip adds a little to every answer; a median of 18 answers stays near 3
    assert SLOWER * 0.95 <= found["slowdown"] < SLOWER * 1.3
    assert len(found["ratios"]) == len(PROBE_TOKENS) * PROBE_REPS * len(engines)
    sizes = sorted(len(p) for p in _Engine.prompts[1:])  # after the warm-up prompt
    assert sizes == sorted(n for n in PROBE_TOKENS for _ in range(PROBE_REPS * len(engines)))
    assert len(set(_Engine.prompts)) == len(_Engine.prompts)  # no prefix-cache hit to gain
