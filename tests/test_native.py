"""The optional compiled router (kvgate.native): a stale or disabled build never shadows the
source. (That the compiled build decides exactly as the source does is checked by
tests/bench/test_bench_determinism.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate import native

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tree with two listed modules' sources, as kvgate.native sees the repository."""
    for module in ("router.tree", "router.core"):
        src = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# {module}\n")
    monkeypatch.setattr(native, "ROOT", tmp_path)
    monkeypatch.setattr(native, "MANIFEST", tmp_path / "router" / "_native.json")
    monkeypatch.setattr(native, "MODULES", ("router.tree", "router.core"))
    return tmp_path


def test_status_pure_native_and_stale(fake_root: Path) -> None:
    assert native.status() == {"router.tree": "pure", "router.core": "pure"}
    for module in native.MODULES:
        native._compiled(module).write_bytes(b"\x7fELF")
    native.MANIFEST.write_text(json.dumps({m: native._digest(m) for m in native.MODULES}))
    assert set(native.status().values()) == {"native"}
    # an edited source makes its build stale
    (fake_root / "router" / "core.py").write_text("# edited\n")
    assert native.status() == {"router.tree": "native", "router.core": "stale"}
    assert native.clean() == 2
    assert not native.MANIFEST.exists()
    assert set(native.status().values()) == {"pure"}


def test_guard_loads_source_when_stale(fake_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for module in native.MODULES:
        native._compiled(module).write_bytes(b"\x7fELF")
    native.MANIFEST.write_text(json.dumps({"router.tree": "0" * 64, "router.core": "0" * 64}))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # undone after the test
    with pytest.warns(RuntimeWarning, match="out of date"):
        native.guard()
    finder = sys.meta_path[0]
    assert isinstance(finder, native._SourceFinder)
    spec = finder.find_spec("router.tree")
    assert spec is not None and spec.origin == str(fake_root / "router" / "tree.py")
    assert finder.find_spec("router.cli") is None  # not listed: the normal import system


def test_native_zero_loads_every_module_from_source() -> None:
    code = (
        "import json, router.tree, kvgate.cost_model, router.policies.e2\n"
        "from kvgate import native\n"
        "print(json.dumps([native.active(), router.tree.__file__, router.policies.e2.__file__,"
        " kvgate.cost_model.__file__]))"
    )
    env = {**os.environ, "KVGATE_NATIVE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    active, *files = json.loads(out.stdout)
    assert active is False
    assert all(f.endswith(".py") for f in files), files


def _dataclass_inits(path: Path) -> list[tuple[str, list[tuple[str, str]], list[tuple[str, str]]]]:
    """(class, declared fields, __init__ parameters) for each dataclass in ``path`` that writes
    its own ``__init__``; each as (name, default source; "" for none, "None" for a factory)."""
    import ast

    out = []
    for cls in ast.walk(ast.parse(path.read_text())):
        if not isinstance(cls, ast.ClassDef) or not any(
            "dataclass" in ast.unparse(d) for d in cls.decorator_list
        ):
            continue
        init = next(
            (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None
        )
        if init is None:
            continue
        fields = []
        for st in cls.body:
            if not isinstance(st, ast.AnnAssign) or "ClassVar" in ast.unparse(st.annotation):
                continue
            default = "" if st.value is None else ast.unparse(st.value)
            if isinstance(st.value, ast.Call) and ast.unparse(st.value.func) == "field":
                kw = {k.arg: ast.unparse(k.value) for k in st.value.keywords}
                default = kw.get("default", "None" if "default_factory" in kw else "")
            fields.append((ast.unparse(st.target), default))
        args = init.args.args[1:]
        defaults = [""] * (len(args) - len(init.args.defaults)) + [
            ast.unparse(d) for d in init.args.defaults
        ]
        out.append((cls.name, fields, [(a.arg, d) for a, d in zip(args, defaults, strict=True)]))
    return out


def test_written_dataclass_inits_take_exactly_the_declared_fields() -> None:
    """The decision path's dataclasses spell out ``__init__`` (compiled by mypyc, see
    router/api.py): it must take every declared field, in order, with the same default, so the
    class means the same with and without the build."""
    found = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        for name, fields, params in _dataclass_inits(path):
            found.append(name)
            assert params == fields, f"{path.name}:{name}.__init__ differs from its fields"
    assert {"RouteRequest", "Candidate", "Decision", "EngineView", "Match"} <= set(found)
