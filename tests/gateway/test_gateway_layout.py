"""The proxy's import arrows: nothing in ``gateway/`` reaches into ``bench/`` (the demo, which
wires the gateway to benchmark workloads, lives in ``bench/demo.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_no_gateway_module_imports_bench() -> None:
    files = sorted(GATEWAY.glob("*.py"))
    assert len(files) > 5
    offenders = {
        f.name: sorted(m for m in imported_modules(f) if m == "bench" or m.startswith("bench."))
        for f in files
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
