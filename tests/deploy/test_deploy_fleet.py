"""``kvgate up`` for real: a fleet of separate processes (real Redis, a router, two gateways in
remote-router mode, two engines) serves the openai SDK through both gateways, exposes every metric
the alert rules and the dashboard use, and leaves no process behind when stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from deploy_support import (
    dashboard_expressions,
    load_dashboard,
    promql_metric_names,
    recorded_names,
)
from deploy_support import rule_expressions as alert_rule_expressions
from prometheus_client.parser import text_string_to_metric_families

from deploy.fleet import FleetConfig, plan_fleet

pytestmark = pytest.mark.redis
ENGINES, GATEWAYS = 2, 2
START_TIMEOUT_S = 90.0


def process_gone(pid: int) -> bool:
    """True when neither the process nor anything in its process group is alive."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        pass
    else:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie of ours would still answer: it is only gone once nothing can signal it.
    return False


class FleetRun:
    """A ``kvgate up`` process and what it wrote."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.status_path = tmp / "status.json"
        self.out_path = tmp / "up.out"
        with self.out_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "kvgate", "up", "--engines", str(ENGINES)),
                    *("--gateways", str(GATEWAYS), "--duration", "240", "--grace", "10"),
                    *("--status-file", str(self.status_path), "--log-dir", str(tmp / "logs")),
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_up(self) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.status_path.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"kvgate up exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"kvgate up not ready in {START_TIMEOUT_S} s:\n{self.output()}")
            time.sleep(0.1)
        return json.loads(self.status_path.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetRun, dict[str, Any]]]:
    run = FleetRun(tmp_path_factory.mktemp("fleet"))
    try:
        status = run.wait_up()
        yield run, status
    finally:
        # The last test stops it properly; this only runs when a test before it failed.
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)
            try:
                run.proc.wait(40)
            except subprocess.TimeoutExpired:
                run.kill()


def urls(status: dict[str, Any], role: str) -> list[str]:
    return [p["url"] for p in status["processes"] if p["role"] == role]


SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def scrape(url: str) -> tuple[dict[str, float], set[str]]:
    """(sample name -> value summed over labels, every series name the endpoint declares).

    A labelled metric with no child yet has HELP and TYPE lines but no sample: its series names
    come from its type, since a query naming it is right as soon as the first child appears.
    """
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    declared: set[str] = set()
    for family in text_string_to_metric_families(text):
        declared |= {family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type]}
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
            declared.add(sample.name)
    return samples, declared


def test_plan_wires_the_remote_router_topology() -> None:
    plan = plan_fleet(FleetConfig(engines=3, gateways=2), "redis://r:1/0", iter(range(5000, 5100)))
    assert [s.role for s in plan] == ["engine"] * 3 + ["router"] + ["gateway"] * 2
    assert len({s.url for s in plan}) == len(plan), "every process has its own port"
    (router,) = [s for s in plan if s.role == "router"]
    for spec in plan:
        if spec.role == "gateway":
            assert spec.argv[spec.argv.index("--router-url") + 1] == router.url
        else:
            assert "redis://r:1/0" in spec.argv, f"{spec.name} does not use the broker"
    with pytest.raises(ValueError):
        plan_fleet(FleetConfig(engines=0), "redis://r:1/0", iter(range(5000, 5100)))


def test_fleet_prints_where_everything_is(fleet: tuple[FleetRun, dict[str, Any]]) -> None:
    run, status = fleet
    roles = [p["role"] for p in status["processes"]]
    assert roles.count("engine") == ENGINES and roles.count("gateway") == GATEWAYS
    assert roles.count("router") == 1
    printed = run.output()
    for p in status["processes"]:
        assert p["url"].startswith("http://127.0.0.1:")
        assert p["url"] in printed and p["name"] in printed
    assert status["redis"] in printed


def test_requests_through_both_gateways(fleet: tuple[FleetRun, dict[str, Any]]) -> None:
    _, status = fleet
    gateways = urls(status, "gateway")
    assert len(gateways) == GATEWAYS
    shared_prefix = "You are kvgate's deployment test. " * 20
    for n, base in enumerate(gateways):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        models = [m.id for m in client.models.list().data]
        assert models, f"{base}: no models"
        model = models[0]
        done = client.completions.create(
            model=model, prompt=shared_prefix + f"gateway {n}", max_tokens=8
        )
        assert done.choices[0].text and done.usage.completion_tokens == 8
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": shared_prefix + f"stream {n}"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # Both gateways asked the one remote router (no gateway fell back to its own routing).
    (router,) = urls(status, "router")
    router_metrics, _ = scrape(router)
    assert router_metrics.get("kvgate_router_decisions_total", 0) >= 2 * GATEWAYS
    for base in gateways:
        metrics, _ = scrape(base)
        assert metrics.get("kvgate_gateway_routing_decisions_total", 0) >= 2, base
        assert metrics.get("kvgate_gateway_fallback_decisions_total", 0) == 0, base
        assert metrics.get("kvgate_gateway_router_degraded", 0) == 0, base


def test_metrics_used_by_alerts_and_dashboard_exist(
    fleet: tuple[FleetRun, dict[str, Any]],
) -> None:
    _, status = fleet
    exposed: set[str] = set()
    for p in status["processes"]:
        samples, declared = scrape(p["url"])
        assert samples, f"{p['name']} exposes no metrics"
        exposed |= declared
    used = {
        name
        for _, expr in alert_rule_expressions() + dashboard_expressions(load_dashboard())
        for name in promql_metric_names(expr)
    }
    used.discard("up")  # Prometheus' own per-target series
    used -= recorded_names()  # made by the rules from the names checked here
    missing = sorted(used - exposed)
    assert not missing, f"used in PromQL but exposed by no component: {missing}"


def test_fleet_stops_cleanly_on_sigint(fleet: tuple[FleetRun, dict[str, Any]]) -> None:
    run, status = fleet
    pids = [p["pid"] for p in status["processes"]]
    assert all(not process_gone(pid) for pid in pids)
    run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(60) == 0, run.output()
    deadline = time.monotonic() + 10
    while not all(process_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if not process_gone(pid)]
    assert not left, f"processes left behind: {left}"
    assert "stopping" in run.output()


def processes_mentioning(marker: str) -> list[int]:
    """Pids whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry.name))
    return found


def test_a_component_that_cannot_start_stops_the_whole_fleet(tmp_path: Path) -> None:
    """The gateways fail at once: the engines and the router, already up, must not be left."""
    marker = f"kvgate-test-{uuid.uuid4().hex}:"
    run = FleetRun(tmp_path, "--prefix", marker, "--gateway-arg=--no-such-option")
    try:
        assert run.proc.wait(60) == 1
    finally:
        run.kill()
    out = run.output()
    assert "gateway-" in out and "exited" in out and "--no-such-option" in out
    assert not run.status_path.exists()
    deadline = time.monotonic() + 10
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_mentioning(marker)


def test_redis_is_found_or_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """--redis-url must answer; without it and nothing on the default port, a private server."""
    import deploy.fleet as fleet_module

    unused = f"redis://127.0.0.1:{next(fleet_module.free_ports())}/0"
    with pytest.raises(fleet_module.FleetError, match="no Redis answers"):
        fleet_module.Fleet(FleetConfig(), redis_url=unused)._redis(fleet_module.free_ports())

    monkeypatch.setattr(fleet_module, "DEFAULT_REDIS_URL", unused)
    fleet = fleet_module.Fleet(FleetConfig(), ready_timeout_s=20)
    url = fleet._redis(fleet_module.free_ports())
    try:
        assert fleet.private_redis is not None and url == fleet.private_redis.url
        assert fleet_module.redis_answers(url)
    finally:
        fleet.stop()
    assert not fleet_module.redis_answers(url, 0.2)
    assert fleet.private_redis.proc is not None and fleet.private_redis.proc.poll() is not None
