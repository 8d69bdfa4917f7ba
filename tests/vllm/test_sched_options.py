"""The scheduler plug-in's settings, its version gate, the SLO it reads from vllm_xargs, and the
purity of its core modules (none of this needs vLLM)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.slo import SLO_CLASSES, Slo, SloError
from kvgate.slo_forward import forward_body, slo_from_xargs, slo_priority
from kvgate.vllm import VllmVersionError, check_vllm_version
from kvgate.vllm.options import OptionsError, parse_options

ROOT = Path(__file__).resolve().parents[2]
PURE = ["kvgate/vllm/book.py", "kvgate/vllm/options.py", "kvgate/slo_forward.py"]
FORBIDDEN = {"asyncio", "aiohttp", "redis", "socket", "time", "threading", "zmq", "random", "vllm"}


@pytest.mark.parametrize("path", PURE)
def test_core_modules_import_no_io_and_no_vllm(path: str) -> None:
    names: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    assert not names & FORBIDDEN, f"{path} imports {sorted(names & FORBIDDEN)}"


def test_the_package_imports_without_importing_vllm() -> None:
    code = "import sys, kvgate.vllm, kvgate.vllm.book; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_untested_vllm_versions_fail_with_a_clear_message() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(VllmVersionError, match=r"tested with vLLM 0\.32\.0.*this is vLLM 0\.33\.1"):
        check_vllm_version("0.33.1")
    check_vllm_version("0.33.1", allow_untested=True)


def test_options_from_additional_config_then_environment() -> None:
    opts = parse_options(
        {
            "kvgate": {
                "profile": "vllm-cpu-small",
                "broker": "redis://r:6379/0",
                "url": "http://10.0.0.5:8000/",
                "scheduler": {"token_budget": 2048, "tpot_guard": 0.8},
            }
        },
        {"KVGATE_DEFAULT_SLO": "chat", "KVGATE_PROFILE": "ignored", "KVGATE_REJECT": "1"},
    )
    assert opts.profile == "vllm-cpu-small" and opts.default_slo == "chat" and opts.reject
    assert opts.url == "http://10.0.0.5:8000" and opts.stream_id() == "vllm-10.0.0.5-8000"
    assert opts.scheduler.token_budget == 2048 and opts.scheduler.tpot_guard == 0.8
    assert not parse_options(None, {}).reporting
    assert parse_options(None, {}).stats_s == 60.0
    assert parse_options(None, {}).max_step_ms == 100.0
    assert parse_options({"kvgate": {"max_step_ms": 0}}, {}).max_step_ms == 0.0
    assert parse_options(None, {"KVGATE_STATS_S": "2"}).stats_s == 2.0


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"kvgate": {"brokr": "x"}}, "unknown kvgate option"),
        ({"kvgate": {"broker": "redis://r"}}, "needs 'url'"),
        ({"kvgate": {"default_slo": "gold"}}, "default_slo"),
        ({"kvgate": {"scheduler": {"token_budget": 1.5}}}, "integer"),
        ({"kvgate": {"scheduler": {"tpot_guard": 2}}}, "tpot_guard"),
        ({"kvgate": {"scheduler": {"budget": 1}}}, "unknown kvgate scheduler"),
        ({"kvgate": {"url": "ftp://x"}}, "http"),
        ({"kvgate": "on"}, "JSON object"),
        ({"kvgate": {"stats_s": 0.5}}, "stats_s"),
        ({"kvgate": {"max_step_ms": -1}}, "max_step_ms"),
        ({"kvgate": {"heartbeat_s": "soon"}}, "heartbeat_s"),
    ],
)
def test_bad_options_are_refused_with_the_reason(raw: dict, match: str) -> None:
    with pytest.raises(OptionsError, match=match):
        parse_options(raw, {})


def test_the_slo_travels_in_vllm_xargs_and_back() -> None:
    chat = SLO_CLASSES["chat"]
    body = {"model": "m", "prompt": "p", "slo": {"class": "chat"}, "vllm_xargs": {"mine": 1}}
    out = forward_body(body, chat, "gw-7", "vllm")
    assert "slo" not in out and "priority" not in out and out["vllm_xargs"]["mine"] == 1
    assert slo_from_xargs(out["vllm_xargs"], SLO_CLASSES["relaxed"]) == (chat, "gw-7")
    pri = forward_body(body, chat, "gw-7", "vllm-priority")
    assert pri["priority"] == slo_priority(chat) == 250
    assert forward_body({**body, "priority": -3}, chat, "r", "vllm-priority")["priority"] == -3
    assert forward_body(body, chat, "r", "none") == body
    custom = Slo(123.0, 45.0, "custom")
    assert slo_from_xargs(forward_body(body, custom, "r", "vllm")["vllm_xargs"], chat)[0] == custom


def test_requests_without_an_slo_get_the_default_and_bad_ones_are_refused() -> None:
    default = SLO_CLASSES["relaxed"]
    assert slo_from_xargs(None, default) == (default, None)
    assert slo_from_xargs({"someone_else": "x"}, default) == (default, None)
    assert slo_from_xargs({"kvgate_slo_class": "file"}, default)[0] == SLO_CLASSES["file"]
    with pytest.raises(SloError):
        slo_from_xargs({"kvgate_slo_class": "gold"}, default)
    with pytest.raises(SloError):
        slo_from_xargs({"kvgate_ttft_ms": -1}, default)
