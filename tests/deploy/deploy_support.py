"""Helpers of the deploy tests: load the deployment files, pull out every ``kvgate`` command line
and every metric name a PromQL expression uses."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose" / "compose.yaml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULES_FILE = DEPLOY / "prometheus" / "rules" / "kvgate.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvgate.json"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = [K8S / "base", K8S / "overlays" / "vllm"]
KVGATE_IMAGES = ("kvgate", "kvgate:local", "ghcr.io/kvgate/kvgate")


def yaml_files() -> list[Path]:
    return sorted(p for ext in ("*.yml", "*.yaml") for p in DEPLOY.rglob(ext))


def json_files() -> list[Path]:
    return sorted(DEPLOY.rglob("*.json"))


def load_yaml_docs(path: Path) -> list[Any]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def kustomize_command() -> list[str] | None:
    """``kustomize build`` or ``kubectl kustomize``, whichever is installed."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    cmd = kustomize_command()
    assert cmd is not None
    out = subprocess.run(
        [*cmd, str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, f"{' '.join(cmd)} {directory} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


def k8s_objects(directory: Path) -> list[dict[str, Any]]:
    """The objects a kustomization renders. Without kustomize (or kubectl): the resource files
    it lists, recursively, minus what its ``$patch: delete`` patches remove; other patches and
    generators are not applied in that case."""
    if kustomize_command() is not None:
        return kustomize_build(directory)
    return _k8s_objects_without_kustomize(directory)


def _k8s_objects_without_kustomize(directory: Path) -> list[dict[str, Any]]:
    (spec,) = load_yaml_docs(directory / "kustomization.yaml")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        target = directory / entry
        if target.is_dir():
            objects += _k8s_objects_without_kustomize(target)
        else:
            objects += load_yaml_docs(target)
    for patch in spec.get("patches", []):
        body = yaml.safe_load(patch["patch"]) if "patch" in patch else None
        if isinstance(body, dict) and body.get("$patch") == "delete":
            gone = (body["kind"], body["metadata"]["name"])
            objects = [o for o in objects if (o["kind"], o["metadata"]["name"]) != gone]
    return objects


def kustomization_files(directory: Path) -> Iterator[Path]:
    """Every file a kustomization refers to (resources, generator files, patch files),
    following resource directories; asserts that each exists."""
    kust = directory / "kustomization.yaml"
    assert kust.is_file(), f"{kust} is missing"
    (spec,) = load_yaml_docs(kust)
    for entry in spec.get("resources", []) + spec.get("components", []):
        target = (directory / entry).resolve()
        assert target.exists(), f"{kust}: resource {entry} does not exist"
        if target.is_dir():
            yield from kustomization_files(target)
        else:
            yield target
    for gen in spec.get("configMapGenerator", []) + spec.get("secretGenerator", []):
        for entry in gen.get("files", []):
            target = directory / entry.split("=", 1)[-1]
            assert target.is_file(), f"{kust}: generator file {entry} does not exist"
            yield target
    for patch in spec.get("patches", []):
        if "path" in patch:
            target = directory / patch["path"]
            assert target.is_file(), f"{kust}: patch {patch['path']} does not exist"
            yield target


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        template = obj.get("spec", {}).get("template", {})
        if obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job") and template:
            yield f"{obj['kind']}/{obj['metadata']['name']}", template["spec"]


def is_kvgate_image(image: str) -> bool:
    return image in KVGATE_IMAGES or image.split(":")[0] in KVGATE_IMAGES


def expand_k8s_vars(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion in container args (unknown names stay as written)."""

    def expand(arg: str) -> str:
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)

    return [expand(a) for a in args]


def container_env(container: dict[str, Any], config_maps: dict[str, dict[str, str]]) -> dict:
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        name = ref.get("configMapRef", {}).get("name")
        assert name in config_maps, f"container {container['name']}: no ConfigMap {name}"
        env.update(config_maps[name])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef"):
            env[var["name"]] = "pod-0"  # metadata.name / namespace: a plausible stand-in
    return env


def k8s_kvgate_commands(directory: Path) -> list[tuple[str, list[str]]]:
    """``(where, args)`` of every container running the kvgate image in a kustomization."""
    objects = k8s_objects(directory)
    config_maps = {
        o["metadata"]["name"]: o.get("data", {}) for o in objects if o.get("kind") == "ConfigMap"
    }
    # Generated ConfigMaps get a hash suffix; references are rewritten to match.
    out = []
    for where, spec in pod_specs(objects):
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            if not is_kvgate_image(c.get("image", "")):
                continue
            assert "command" not in c, f"{where}/{c['name']}: use args; the entrypoint is kvgate"
            args = expand_k8s_vars(list(c.get("args", [])), container_env(c, config_maps))
            out.append((f"{directory.relative_to(ROOT)} {where}/{c['name']}", args))
    return out


def compose_kvgate_commands() -> list[tuple[str, list[str]]]:
    (compose,) = load_yaml_docs(COMPOSE_FILE)
    out = []
    for name, service in compose["services"].items():
        if is_kvgate_image(service.get("image", "")):
            command = service.get("command")
            assert isinstance(command, list), f"compose service {name}: command must be a list"
            out.append((f"compose {name}", [str(a) for a in command]))
    return out


# ---- PromQL -------------------------------------------------------------------------------

PROMQL_KEYWORDS = {
    # aggregation operators and their modifiers
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "atan2",
    # numbers spelled as identifiers
    "inf", "nan",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, labels and durations removed).

    Grafana variables are replaced first: ``$__rate_interval`` by a duration, ``$var`` and
    ``${var}`` by a label value.
    """
    text = re.sub(r"\$__(rate_)?interval|\$__range", "5m", expr)
    text = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "x", text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)  # string literals
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # range and subquery selectors
    # label lists after by/without/on/ignoring/group_left/group_right
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


def dashboard_expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every Prometheus query in a dashboard (rows included)."""
    out = []

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", "?"), target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query" and isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and isinstance(query, str):
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", query.strip())
            if m:
                out.append((f"variable {var['name']}", m.group(1)))
    return out


def rule_expressions() -> list[tuple[str, str]]:
    (rules,) = load_yaml_docs(RULES_FILE)
    return [
        (rule.get("alert") or rule.get("record"), rule["expr"])
        for group in rules["groups"]
        for rule in group["rules"]
    ]


def recorded_names() -> set[str]:
    """Series the rules file records (usable in other rules and the dashboard)."""
    (rules,) = load_yaml_docs(RULES_FILE)
    return {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())
