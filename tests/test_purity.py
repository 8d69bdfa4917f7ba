"""The functional cores import no I/O: no asyncio, aiohttp, redis, sockets or clocks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"asyncio", "aiohttp", "redis", "socket", "time", "threading", "zmq", "random"}

# Modules that must stay pure. Parts add their core modules here as they grow.
PURE_MODULES = [
    "broker/events.py",
    "broker/codec.py",
    "engine_reporter/hashing.py",
    "engine_reporter/builder.py",
    "broker/tracker.py",
    "kvgate/cost_model.py",
    "kvgate/slo.py",
    "kvgate/openai_request.py",
    "router/api.py",
    "engine/core.py",
    "engine/costs.py",
    "engine/prefix_cache.py",
    "engine/text.py",
    "engine/fit.py",
    "router/block_index.py",
    "router/tree_node.py",
    "router/tree.py",
    "router/engine_state.py",
    "router/speculative.py",
    "router/slo_mix.py",
    "router/cluster_state.py",
    "router/cluster.py",
    "router/view.py",
    "router/core.py",
    "router/wire.py",
    "router/pd.py",
    "kvgate/kv_transfer.py",
    "kvgate/vllm/book.py",
    "bench/sim/loop.py",
    "bench/sim/world.py",
    "bench/metrics.py",
    "bench/workloads/request.py",
    "bench/workloads/transform.py",
    "gateway/pool.py",
    "gateway/config.py",
    "kvgate/stats.py",
    "engine_reporter/vllm/wire.py",
    "engine_reporter/vllm/tokens.py",
    "engine_reporter/vllm/translate.py",
    "engine_reporter/vllm/sequence.py",
    "engine_reporter/vllm/metrics.py",
]
# Whole packages whose every module is pure.
PURE_PACKAGES = ["engine/scheduler", "router/policies"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _pure_files() -> list[Path]:
    files = [ROOT / m for m in PURE_MODULES]
    for pkg in PURE_PACKAGES:
        files.extend(sorted((ROOT / pkg).glob("*.py")))
    return files


@pytest.mark.parametrize("path", _pure_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_imports_no_io(path: Path) -> None:
    assert path.exists(), f"{path} listed as a pure core but missing"
    bad = _imports(path) & FORBIDDEN
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
