"""The ``kvgate`` command: one console script, one subcommand per part.

Each part owns its subcommand in its own package: a module with ``add_arguments(parser)`` and
``run(args) -> int``. This table is the only list of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help). The module is imported only when it is needed.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("bench.demo", "gateway, router and simulated engines in one process"),
    "gateway": ("gateway.cli", "the OpenAI-compatible reverse proxy"),
    "router": ("router.cli", "the stateful router service (POST /route, GET /state, /metrics)"),
    "engine": ("engine.cli", "kvgate's simulated OpenAI engine with the local SLO scheduler"),
    "bench": ("bench.cli", "trace replay, cluster simulation and reports"),
    "bridge": ("engine_reporter.vllm.cli", "bridge a real engine's KV events into kvgate"),
    "up": ("deploy.fleet", "run the distributed topology locally as separate processes"),
    "native": ("kvgate.native", "build, check or remove the optional compiled router (mypyc)"),
    "logs": ("kvgate.logs", "summarise an access log: per-engine shares, policies and reasons"),
}


def _available() -> dict[str, tuple[str, str]]:
    """Subcommands whose module is present in this installation."""
    out = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None:
            continue
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:
            continue
        out[name] = (module, help_text)
    return out


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="KV-cache-aware, SLO-aware routing gateway for LLM inference fleets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = None
    if argv:
        wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in _available().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Importing every part costs start-up time; only the chosen one adds its arguments.
        if wanted is None or wanted == name:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
