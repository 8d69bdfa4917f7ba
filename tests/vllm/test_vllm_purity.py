"""The bridge's decoding, token mapping, translation, sequence and metrics modules do no I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE = ["wire.py", "tokens.py", "translate.py", "sequence.py", "metrics.py"]
FORBIDDEN = {"asyncio", "aiohttp", "redis", "socket", "time", "threading", "zmq", "random"}


@pytest.mark.parametrize("name", PURE)
def test_bridge_core_module_imports_no_io(name: str) -> None:
    tree = ast.parse((ROOT / "engine_reporter" / "vllm" / name).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    assert not names & FORBIDDEN, f"{name} imports {sorted(names & FORBIDDEN)}"
