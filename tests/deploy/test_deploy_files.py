"""The deployment files: they parse, every kvgate command in them is accepted by the real CLI,
promtool accepts the Prometheus config, the rules and the dashboard's queries, the Kubernetes
manifests build and hold what production needs, and the compose file is consistent."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_support import (
    COMPOSE_FILE,
    DEPLOY,
    KUSTOMIZATIONS,
    PROMETHEUS_CONFIG,
    ROOT,
    RULES_FILE,
    compose_kvgate_commands,
    container_env,
    dashboard_expressions,
    is_kvgate_image,
    k8s_kvgate_commands,
    k8s_objects,
    kustomization_files,
    load_dashboard,
    load_yaml_docs,
    pod_specs,
    promql_metric_names,
    rule_expressions,
)
from redis_server import system_binary

from deploy import probe
from deploy.fleet import FleetConfig, plan_fleet
from kvgate.cli import build_parser


def promtool() -> str:
    """promtool must be there: installed with apt-get when missing; these checks never skip."""
    try:
        return system_binary("promtool", "prometheus")
    except RuntimeError as exc:
        pytest.fail(str(exc))


# ---- parsing -------------------------------------------------------------------------------


def test_every_yaml_and_json_file_parses() -> None:
    yaml_paths = sorted(p for ext in ("*.yml", "*.yaml") for p in DEPLOY.rglob(ext))
    json_paths = sorted(DEPLOY.rglob("*.json"))
    assert len(yaml_paths) >= 10 and json_paths, "the deploy tree is incomplete"
    for path in yaml_paths:
        assert load_yaml_docs(path), f"{path} is empty"
    for path in json_paths:
        json.loads(path.read_text())


# ---- commands against the real CLI ---------------------------------------------------------


def all_kvgate_commands() -> list[tuple[str, list[str]]]:
    commands = compose_kvgate_commands()
    for directory in KUSTOMIZATIONS:
        commands += k8s_kvgate_commands(directory)
    plan = plan_fleet(
        FleetConfig(engines=2, gateways=2), "redis://127.0.0.1:6379/0", iter(range(9000, 9100))
    )
    commands += [(f"kvgate up {spec.name}", list(spec.argv)) for spec in plan]
    return commands


def test_commands_cover_every_role() -> None:
    roles = {argv[0] for _, argv in all_kvgate_commands()}
    assert {"gateway", "router", "engine", "bridge"} <= roles


@pytest.mark.parametrize(
    ("where", "argv"), all_kvgate_commands(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_command_is_accepted_by_the_real_cli(where: str, argv: list[str]) -> None:
    """What argparse of the installed ``kvgate`` says about the exact arguments in the file."""
    parser = build_parser(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `kvgate {' '.join(argv)}` rejected ({exc.code}):\n{err.getvalue()}")
    assert callable(getattr(args, "_run", None)), f"{where}: no runnable subcommand"
    for arg in argv:
        assert "$(" not in arg, f"{where}: {arg!r} refers to a variable the pod does not define"


# ---- Prometheus ----------------------------------------------------------------------------


def test_promtool_checks_config_and_rules(tmp_path: Path) -> None:
    tool = promtool()
    # The config names its rule files by their path in the container: check it with them there.
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    config["rule_files"] = [str(RULES_FILE)]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    out = subprocess.run([tool, "check", "config", str(local)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([tool, "check", "rules", str(RULES_FILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_rules_cover_the_required_conditions() -> None:
    (rules,) = load_yaml_docs(RULES_FILE)
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    for name in ("KvgateSloAttainmentLow", "KvgateBrokerLagHigh", "KvgateEngineDown",
                 "KvgateRouterTreeNearBudget", "KvgateRouterUnknownProfile",
                 "KvgateRouterEventFeedErrors"):  # fmt: skip
        assert name in alerts, f"missing alert {name}"
        rule = alerts[name]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert "for" in rule


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each dashboard query, as a recording rule, through promtool's PromQL parser."""
    tool = promtool()
    exprs = dashboard_expressions(load_dashboard())
    assert len(exprs) >= 8
    rules = [
        {"record": f"kvgate:dashboard_query_{i}", "expr": expr.replace("$__rate_interval", "1m")}
        for i, (_, expr) in enumerate(exprs)
    ]
    for rule in rules:  # template variables become regex matchers that match anything
        rule["expr"] = rule["expr"].replace('=~"$engine"', '=~".*"').replace('"$engine"', '".*"')
        assert "$" not in rule["expr"], f"unhandled Grafana variable in {rule['expr']}"
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboard_has_the_required_panels() -> None:
    dashboard = load_dashboard()
    titles = " | ".join(title.lower() for title, _ in dashboard_expressions(dashboard))
    for words in ("ttft", "tpot", "slo attainment", "prefix hit", "engine load", "decisions",
                  "broker lag"):  # fmt: skip
        assert words in titles, f"no dashboard panel about {words!r}"
    uids = [p.get("datasource", {}).get("uid") for p in dashboard["panels"] if "targets" in p]
    assert set(uids) == {"${datasource}"}, "every panel queries the selected datasource"


def test_metric_names_in_rules_and_dashboard_are_extracted() -> None:
    """The extraction the live metrics test relies on finds names in every expression."""
    for where, expr in rule_expressions() + dashboard_expressions(load_dashboard()):
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        assert all(n.startswith(("kvgate_", "kvgate:")) or n == "up" for n in names), names


def test_kubernetes_rule_copy_matches_the_rules_file() -> None:
    """The PrometheusRule carries exactly deploy/prometheus/rules (one source, checked here)."""
    (rules,) = load_yaml_docs(RULES_FILE)
    objects = load_yaml_docs(DEPLOY / "k8s" / "base" / "monitoring.yaml")
    (prometheus_rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert prometheus_rule["spec"] == rules


# ---- Kubernetes ----------------------------------------------------------------------------


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_kustomization_builds(directory: Path) -> None:
    """`kustomize build` (kubectl kustomize) when installed; else the listed files, parsed."""
    list(kustomization_files(directory))  # every referenced file exists
    objects = k8s_objects(directory)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for expected in [
        ("Deployment", "kvgate-gateway"),
        ("Service", "kvgate-gateway"),
        ("HorizontalPodAutoscaler", "kvgate-gateway"),
        ("PodDisruptionBudget", "kvgate-gateway"),
        ("Deployment", "kvgate-router"),
        ("StatefulSet", "kvgate-redis"),
        ("ServiceMonitor", "kvgate-gateway"),
        ("PrometheusRule", "kvgate"),
        ("ConfigMap", "kvgate-config"),
    ]:
        assert expected in kinds, f"{directory.name}: no {expected}"
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_every_container_is_probed_limited_and_locked_down(directory: Path) -> None:
    for where, spec in pod_specs(k8s_objects(directory)):
        pod_security = spec.get("securityContext", {})
        for c in spec["containers"]:
            name = f"{directory.name} {where}/{c['name']}"
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{name}: probes"
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{name}: {kind}"
            security = c.get("securityContext", {})
            run_as_non_root = security.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
            assert run_as_non_root is True, f"{name}: runAsNonRoot"
            assert security.get("readOnlyRootFilesystem") is True, f"{name}: read-only root"
            assert security.get("allowPrivilegeEscalation") is False, f"{name}: privilege"
            assert security.get("capabilities", {}).get("drop") == ["ALL"], f"{name}: caps"


def test_vllm_overlay_runs_the_bridge_beside_each_vllm() -> None:
    objects = k8s_objects(DEPLOY / "k8s" / "overlays" / "vllm")
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("StatefulSet", "kvgate-engine") not in names, "simulated engines must be gone"
    engines = [
        (where, spec)
        for where, spec in pod_specs(objects)
        if any("vllm" in c.get("image", "") for c in spec["containers"])
    ]
    assert len(engines) == 1
    where, spec = engines[0]
    bridges = [c for c in spec["containers"] if is_kvgate_image(c["image"])]
    assert len(bridges) == 1 and bridges[0]["args"][:2] == ["bridge", "vllm"], where
    # Its exec probes run deploy.probe through a shell (probes get no $(VAR) expansion): the
    # arguments, with the container's variables filled in, must satisfy the probe's parser.
    bridge = bridges[0]
    config_maps = {
        o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"
    }
    env = container_env(bridge, config_maps)
    for kind in ("readinessProbe", "livenessProbe"):
        shell, flag, script = bridge[kind]["exec"]["command"]
        assert (shell, flag) == ("sh", "-c"), kind
        words = [w for w in shlex.split(script) if w != "exec"]
        assert words[:3] == ["python", "-m", "deploy.probe"], kind
        argv = [re.sub(r"\$(\w+)", lambda m: env[m[1]], w) for w in words[3:]]
        probe_args = probe.build_parser().parse_args(argv)
        assert probe_args.broker.startswith("redis+sentinel://") and probe_args.engine_id


# ---- compose -------------------------------------------------------------------------------


def test_compose_file_is_consistent() -> None:
    """What `docker compose config` would reject, checked without Docker (no engine here)."""
    (compose,) = load_yaml_docs(COMPOSE_FILE)
    services = compose["services"]
    roles = [argv[0] for _, argv in compose_kvgate_commands()]
    assert roles.count("engine") == 4 and roles.count("gateway") == 2 and "router" in roles
    assert {"redis", "prometheus", "grafana"} <= set(services)
    published = []
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, f"{name}: no image or build"
        if "build" in svc:
            build = svc["build"]
            context = (COMPOSE_FILE.parent / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), f"{name}: Dockerfile not found"
        deps = svc.get("depends_on", {})
        for dep in deps:
            assert dep in services, f"{name} depends on unknown service {dep}"
            if isinstance(deps, dict) and deps[dep].get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}'s healthcheck"
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_FILE.parent / source).exists(), f"{name}: {source} missing"
            else:
                assert source in compose.get("volumes", {}), f"{name}: volume {source}"
        published += [str(p).split(":")[0] for p in svc.get("ports", [])]
        test = svc.get("healthcheck", {}).get("test")
        if test:
            assert test[0] in ("CMD", "CMD-SHELL"), f"{name}: healthcheck form"
    assert len(published) == len(set(published)), f"a host port is published twice: {published}"
    for _, argv in compose_kvgate_commands():
        for arg in argv:  # every service a command names exists
            for host in ("redis", "router"):
                if f"//{host}:" in arg:
                    assert host in services


def test_compose_prometheus_scrapes_every_kvgate_service() -> None:
    (compose,) = load_yaml_docs(COMPOSE_FILE)
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    targets = {
        t.split(":")[0]
        for job in config["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    kvgate_services = {
        n for n, s in compose["services"].items() if is_kvgate_image(s.get("image", ""))
    }
    assert kvgate_services <= targets


def test_dockerfile_runs_as_non_root_from_python_311_slim() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    froms = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert froms and all(f == "python:3.11-slim" for f in froms)
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert "pip install" in text and 'ENTRYPOINT ["kvgate"]' in text
    assert (ROOT / "pyproject.toml").is_file()


def test_tree_budget_alert_is_relative_to_the_routers_budget() -> None:
    """The alert compares the tree with the budget each router exports, and every deployed
    router states its budget explicitly (so the memory limit beside it can be sized)."""
    (rule,) = [e for name, e in rule_expressions() if name == "KvgateRouterTreeNearBudget"]
    assert "kvgate_router_tree_bytes / kvgate_router_tree_budget_bytes" in rule, rule
    for where, argv in all_kvgate_commands():
        if argv[0] == "router" and not where.startswith("kvgate up"):
            assert any(a.startswith("--tree-budget-mb=") for a in argv), where
