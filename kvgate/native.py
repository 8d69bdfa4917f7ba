"""Optional native build of the router's hot path with mypyc (``kvgate native build``).

Why: a routing decision is a few hundred attribute reads and dict operations over the cluster
state; compiled by mypyc (the same source, type-checked, turned into C) it runs 1.5-2x faster,
which is what brings ``Router.route`` under its latency target. The pure-Python modules stay
the reference: every module works unchanged without the build, and the build is skipped with
a warning when mypy or a C compiler is missing.

The compiled modules sit next to their sources (``router/tree.cpython-311-...so``, ignored by
git). A stale build must never shadow edited source, so the build writes a manifest of the
sources' hashes and :func:`guard` (run by ``kvgate/__init__.py``, which every listed
module's import passes through) makes Python load every
listed module from source when any hash differs, or when ``KVGATE_NATIVE=0``.

    kvgate native build     # compile (about a minute on 2 cores)
    kvgate native status    # compiled, stale or pure, per module
    kvgate native clean     # remove the compiled modules
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the decision path: the cost model, the tree, cluster state, the router and every policy
MODULES = (
    "kvgate.cost_model",
    "router.api",
    "router.block_index",
    "router.tree_node",
    "router.tree",
    "router.keytree",
    "router.engine_state",
    "router.speculative",
    "router.slo_mix",
    "router.cluster_state",
    "router.cluster",
    "router.view",
    "router.core",
    "router.policies.base",
    "router.policies.feasibility",
    "router.policies.registry",
    "router.policies.e2",
    "router.policies.round_robin",
    "router.policies.least_load",
    "router.policies.power_of_two",
    "router.policies.cache_aware",
    "router.policies.session_affinity",
)
# kvgate's packages the compiled modules import (copied for the build, see :func:`build`)
PACKAGES = ("kvgate", "router", "broker", "engine_reporter")
GROUP = "kvgate.router_native"  # mypyc's shared library, inside the kvgate package
MANIFEST = ROOT / "router" / "_native.json"
_EXT = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _source(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _compiled(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_name(module.rsplit(".", 1)[1] + _EXT)


def _group_libs(root: Path) -> list[Path]:
    """mypyc's shared library of the group under ``root`` (one per ABI suffix)."""
    package, _, name = GROUP.rpartition(".")
    return list(root.joinpath(*package.split(".")).glob(f"{name}__mypyc*{_EXT}"))


def _digest(module: str) -> str:
    return hashlib.sha256(_source(module).read_bytes()).hexdigest()


def status() -> dict[str, str]:
    """Per module: ``native`` (compiled and current), ``stale`` (source changed since the
    build) or ``pure`` (not compiled)."""
    try:
        built = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        built = {}
    out = {}
    for m in MODULES:
        if not _compiled(m).exists():
            out[m] = "pure"
        else:
            out[m] = "native" if built.get(m) == _digest(m) else "stale"
    return out


def active() -> bool:
    """Whether the router's modules were loaded compiled (for logs and benchmark results)."""
    import router.tree

    return not str(getattr(router.tree, "__file__", "")).endswith(".py")


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Loads the listed modules from their ``.py`` files, shadowing compiled builds."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = frozenset(modules)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        src = _source(fullname)
        loader = importlib.machinery.SourceFileLoader(fullname, str(src))
        return importlib.util.spec_from_file_location(fullname, src, loader=loader)


def guard() -> None:
    """Use the compiled modules only when all of them are current (they share one library);
    otherwise, or with ``KVGATE_NATIVE=0``, load every one from source (warning if stale)."""
    if any(isinstance(f, _SourceFinder) for f in sys.meta_path):
        return
    states = status()
    if all(s == "pure" for s in states.values()):
        return
    forced = os.environ.get("KVGATE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")
    if not forced and all(s == "native" for s in states.values()):
        return
    if not forced and sys.argv[1:2] != ["native"]:  # (``kvgate native build`` fixes it)
        stale = sorted(m for m, s in states.items() if s != "native")
        warnings.warn(
            f"kvgate: compiled router modules are out of date ({', '.join(stale)}); running "
            "the pure-Python source. Rebuild with: kvgate native build",
            RuntimeWarning,
            stacklevel=2,
        )
    sys.meta_path.insert(0, _SourceFinder(MODULES))


def clean() -> int:
    """Remove the compiled modules, their shared library and the manifest."""
    removed = 0
    for m in MODULES:
        p = _compiled(m)
        if p.exists():
            p.unlink()
            removed += 1
    for lib in _group_libs(ROOT):
        lib.unlink()
        removed += 1
    MANIFEST.unlink(missing_ok=True)
    return removed


def build(verbose: bool = False) -> bool:
    """Compile :data:`MODULES` with mypyc and put the results next to their sources; False
    (with the reason on stderr) when mypy or a C compiler is unavailable or the build fails:
    the source keeps working.

    The build runs on a copy of kvgate's own packages in a temporary directory, so it works
    the same from a checkout and from site-packages (where other top-level modules would look
    like part of the program to mypy)."""
    if importlib.util.find_spec("mypyc") is None:
        print(
            "kvgate native: mypy is not installed; the router runs as pure Python", file=sys.stderr
        )
        return False
    clean()
    digests = {m: _digest(m) for m in MODULES}
    with tempfile.TemporaryDirectory(prefix="kvgate-native-") as tmp:
        src = Path(tmp) / "src"
        for package in PACKAGES:
            if (ROOT / package).is_dir():
                shutil.copytree(
                    ROOT / package, src / package, ignore=shutil.ignore_patterns("*.so", "*.pyc")
                )
        setup = Path(tmp) / "setup.py"
        setup.write_text(
            "from setuptools import setup\n"
            "from mypyc.build import mypycify\n"
            f"files = {[str(_source(m).relative_to(ROOT)) for m in MODULES]!r}\n"
            "files = ['--ignore-missing-imports', '--follow-imports=silent', *files]\n"
            f"setup(name='kvgate-native', ext_modules=mypycify(files, opt_level='3', "
            f"group_name={GROUP!r}, strip_asserts=False, target_dir={str(Path(tmp) / 'c')!r}))\n"
        )
        cmd = [
            sys.executable,
            str(setup),
            "build_ext",
            "--inplace",
            "--build-temp",
            str(Path(tmp) / "temp"),
        ]
        env = dict(os.environ, MYPY_CACHE_DIR=str(Path(tmp) / "mypy_cache"))
        proc = subprocess.run(cmd, cwd=src, env=env, capture_output=not verbose, text=True)
        if proc.returncode == 0:
            built_files = [src / _compiled(m).relative_to(ROOT) for m in MODULES]
            for built in built_files + _group_libs(src):
                dest = ROOT / built.relative_to(src)
                shutil.copyfile(built, dest.with_name(dest.name + ".tmp"))
                dest.with_name(dest.name + ".tmp").replace(dest)  # atomic: never half a library
    if proc.returncode != 0:
        tail = (proc.stdout or "")[-3000:] + (proc.stderr or "")[-3000:]
        print(
            f"kvgate native: build failed; the router runs as pure Python\n{tail}", file=sys.stderr
        )
        clean()
        return False
    MANIFEST.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("build", "status", "clean"))
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.add_argument(
        "--require", action="store_true", help="build: exit 1 when the build cannot be done"
    )
    p.add_argument(
        "--if-stale", action="store_true", help="build: only when a module is stale or missing"
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "build":
        if args.if_stale and all(s == "native" for s in status().values()):
            print("kvgate native: up to date")
            return 0
        ok = build(args.verbose)
        print("kvgate native: compiled" if ok else "kvgate native: not compiled (pure Python)")
        return 0 if ok or not args.require else 1
    if args.action == "clean":
        print(f"kvgate native: removed {clean()} files")
        return 0
    for m, s in status().items():
        print(f"{s:7s} {m}")
    return 0
