"""Small helpers of the benchmarks that start real servers (vLLM engines, kvgate, peer routers)
as subprocesses on loopback: a JSON HTTP call, a free port, waiting for a server to answer."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request

LOOPBACK = "127.0.0.1"
HTTP_ERRORS = (urllib.error.URLError, OSError, ValueError)


def http(
    method: str, url: str, body: dict | None = None, timeout: float = 120, token: str = ""
) -> tuple[int, bytes]:
    """One request with an optional JSON body: (status, body); an HTTP error status is an
    answer, not an exception."""
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def wait_http(url: str, deadline_s: float, procs: list[subprocess.Popen]) -> None:
    """Until ``url`` answers below 500; fails at once if one of ``procs`` exits first."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"process {p.args[:4]} exited with {p.returncode}")
        with contextlib.suppress(*HTTP_ERRORS):
            if http("GET", url, timeout=2)[0] < 500:
                return
        time.sleep(1)
    raise RuntimeError(f"{url} did not come up in {deadline_s} s")
