"""Bad input every server command shares (ports, broker URLs): one line and exit 2, never a
traceback, and the same line from every command (kvgate.cli_support is their one home)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest

from kvgate.cli import build_parser, main

# The ports these tests may hold: loopback, 18400-18499.
PORTS = range(18400, 18500)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port in the test range that a listening socket of this test holds."""
    for candidate in PORTS:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", candidate))
        except OSError:
            sock.close()
            continue
        sock.listen(1)
        try:
            yield candidate
        finally:
            sock.close()
        return
    pytest.skip("no free port in 18400-18499")


SERVERS = {  # each listens on 127.0.0.1
    "gateway": ["gateway", "--log-level", "error"],
    "engine": ["engine", "--log-level", "error"],
    "router": ["router", "--broker", "memory://", "--log-level", "error"],
    "demo": ["demo", "--serve", "--engines", "1"],
}


@pytest.mark.parametrize("command", sorted(SERVERS))
@pytest.mark.parametrize("bad", ["65536", "-1", "http"])
def test_port_out_of_range_is_refused_at_parsing(
    command: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*SERVERS[command], "--port", bad]
    with pytest.raises(SystemExit) as exc:
        build_parser(argv).parse_args(argv)  # refused before anything starts
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--port" in err and "0-65535" in err and "Traceback" not in err


@pytest.mark.parametrize("command", sorted(SERVERS))
def test_port_in_use_is_one_line_and_exit_2(
    command: str, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SERVERS[command], "--port", str(busy_port)]) == 2
    err = capsys.readouterr().err
    assert f"kvgate {command}: error: cannot listen on 127.0.0.1:{busy_port}:" in err


def test_gateway_workers_port_in_use_says_the_same(
    busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The multi-process gateway reserves the port itself: the same message."""
    args = ["gateway", "--log-level", "error", "--port", str(busy_port), "--workers", "2"]
    assert main([*args, "--broker", "redis://127.0.0.1:6379/12"]) == 2
    assert f"kvgate gateway: error: cannot listen on 127.0.0.1:{busy_port}:" in (
        capsys.readouterr().err
    )


BAD_BROKERS = ["nonsense://x", "redis://127.0.0.1:abc/10", "redis+sentinel://", "", "redis://h/x"]
BROKER_FLAGS = {
    "gateway": ["gateway", "--broker"],
    "router": ["router", "--broker"],
    "engine": ["engine", "--broker"],
    "bridge": ["bridge", "vllm", "--zmq", "tcp://127.0.0.1:18401", "--model-dir", ".", "--broker"],
    "up": ["up", "--redis-url"],
}


@pytest.mark.parametrize("command", sorted(BROKER_FLAGS))
@pytest.mark.parametrize("bad", BAD_BROKERS)
def test_bad_broker_url_is_refused_at_parsing(
    command: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*BROKER_FLAGS[command], bad]
    with pytest.raises(SystemExit) as exc:
        build_parser(argv).parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"kvgate {argv[0]}") and repr(bad) in err[-1]
    assert "--broker" in err[-1] or "--redis-url" in err[-1]


def test_up_takes_only_a_plain_redis_url(capsys: pytest.CaptureFixture[str]) -> None:
    """kvgate up pings its Redis itself and hands it to every process: memory:// or a
    Sentinel URL cannot be that."""
    for bad in ("memory://", "redis+sentinel://h/svc"):
        with pytest.raises(SystemExit):
            build_parser(["up"]).parse_args(["up", "--redis-url", bad])
        assert "unsupported scheme" in capsys.readouterr().err


def test_gateway_broker_url_from_the_environment_is_checked_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGATE_BROKER_URL", "nonsense://x")
    with pytest.raises(SystemExit):
        build_parser(["gateway"]).parse_args(["gateway"])
    assert "'nonsense://x'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "good",
    ["memory://", "redis://127.0.0.1:6379/12", "rediss://u:p@h/0", "unix:///tmp/r.sock",
     "redis+sentinel://:pw@h1:26379,h2/mymaster/2"],
)  # fmt: skip
def test_good_broker_urls_pass(good: str) -> None:
    argv = ["router", "--broker", good]
    assert build_parser(argv).parse_args(argv).broker == good


@pytest.mark.parametrize("command", ["gateway", "engine"])
@pytest.mark.parametrize("bad", ["missing", "folder", "syntax"])
def test_a_bad_chat_template_is_one_line_before_anything_starts(
    command: str, bad: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing path was a FileNotFoundError traceback from the gateway's startup."""
    path = {"missing": tmp_path / "nonexistent" / "dir", "folder": tmp_path}.get(bad)
    if path is None:
        path = tmp_path / "bad.jinja"
        path.write_text("{% if %}")
    argv = [*SERVERS[command], "--port", "0", "--chat-template", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"kvgate {command}: error: --chat-template {path}: ")


@pytest.mark.parametrize("module", ["zmq", "msgspec"])
def test_bridge_without_the_vllm_extra_names_it(
    module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain install has no pyzmq: that was a ModuleNotFoundError traceback."""
    monkeypatch.setitem(sys.modules, module, None)  # (import raises ImportError)
    argv = ["bridge", "vllm", "--zmq", "tcp://127.0.0.1:18401", "--model-dir", ".",
            "--engine-url", "http://127.0.0.1:18402", "--broker", "memory://"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvgate bridge vllm: error: the vLLM bridge needs kvgate's 'vllm'")
    assert f"missing: {module}" in err and "pip install 'kvgate[vllm]'" in err


@pytest.mark.parametrize(
    "argv",
    [["gateway", "--router-url", "notaurl"], ["gateway", "--router-url", "http://h:abc"],
     ["bench", "replay", "--url", "notaurl"]],
)  # fmt: skip
def test_a_url_that_is_not_http_is_refused_at_parsing(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The gateway started and answered 503 forever; the replay exited 0 having sent nothing."""
    with pytest.raises(SystemExit) as exc:
        build_parser(argv).parse_args(argv)
    assert exc.value.code == 2
    assert f"{argv[-2]}: {argv[-1]!r} is not an http(s) URL" in capsys.readouterr().err


def test_replay_that_no_request_survives_says_why_and_fails(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dead port: every request a connection error, which the run now names, exit 1."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    for dead in PORTS:  # a port of the test range that nothing listens on
        try:
            sock.bind(("127.0.0.1", dead))
            break
        except OSError:
            continue
    sock.close()
    rc = main(["bench", "replay", "--url", f"http://127.0.0.1:{dead}", "--trace", "tool_use",
               "--duration", "2", "--timeout", "5", "--no-progress",
               "--out", str(tmp_path / "r")])  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err
    assert "no request succeeded; the first failed with status 0:" in err
    assert f"127.0.0.1:{dead}" in err


def test_the_bridge_announces_the_prefill_chunk_it_is_told_and_refuses_nonsense() -> None:
    """``--prefill-chunk-tokens`` (vLLM's --max-num-batched-tokens) goes into the bridge's
    heartbeats; a count below one is an error before anything starts."""
    from engine_reporter.vllm.cli import build_config

    argv = ["bridge", "vllm", "--zmq", "tcp://127.0.0.1:18401", "--model-dir", ".",
            "--engine-url", "http://127.0.0.1:18402", "--broker", "memory://"]  # fmt: skip
    parser = build_parser()
    assert build_config(parser.parse_args(argv)).prefill_chunk_tokens is None
    told = parser.parse_args([*argv, "--prefill-chunk-tokens", "2048"])
    assert build_config(told).prefill_chunk_tokens == 2048
    with pytest.raises(SystemExit, match="--prefill-chunk-tokens must be at least 1"):
        build_config(parser.parse_args([*argv, "--prefill-chunk-tokens", "0"]))
