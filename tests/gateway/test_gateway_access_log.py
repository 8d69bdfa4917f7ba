"""The access log: one JSON line per request with every routing decision's facts (engine,
policy, reason, matched bytes, SLO class, retries, upstream status, TTFT, total time), the
fast write path, and ``kvgate logs explain``."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import aiohttp
import orjson
import pytest
from gw_harness import MODEL, gateway_stack

from gateway.config import GatewayConfig
from kvgate import logs as kvlogs
from kvgate.cli import main as kvgate_main
from kvgate.logs import ACCESS_LOGGER, AccessLog, JsonFormatter, explain, setup_logging

C = "/v1/completions"


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    """The access records caplog saw, as the JSON lines the log would hold."""
    fmt = JsonFormatter()
    return [orjson.loads(fmt.format(r)) for r in caplog.records if r.name == ACCESS_LOGGER]


async def post(s: aiohttp.ClientSession, url: str, body: dict, **headers: str) -> int:
    async with s.post(url, json=body, headers=headers) as r:
        await r.read()
        return r.status


async def test_every_decision_is_in_the_access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    cfg = GatewayConfig(health_interval_s=60, refresh_interval_s=60)
    async with gateway_stack(2, cfg, chunks=3) as st, aiohttp.ClientSession() as s:
        url = st.url + C
        assert await post(s, url, {"model": MODEL, "prompt": "abcd", "stream": True}) == 200
        body = {"model": MODEL, "prompt": "xy", "slo": {"class": "chat"}}
        assert await post(s, url, body, **{"x-request-id": "plain-1"}) == 200
        st.engines[1].fail_status = 500  # the next request goes to e1 first, then e0
        assert await post(s, url, {"model": MODEL, "prompt": "retry me"}) == 200
        st.routing.shed_all = True
        assert await post(s, url, {"model": MODEL, "prompt": "shed"}) == 429
        st.routing.shed_all = False
        assert await post(s, url, {"model": "nope", "prompt": "x"}) == 404
    lines = access_lines(caplog)
    assert len(lines) == 5  # one line per request, nothing else on this logger
    stream, plain, retried, shed, unknown = lines
    assert stream["msg"] == "request" and stream["path"] == C and stream["status"] == 200
    assert (stream["engine"], stream["policy"], stream["reason"]) == ("e1", "list", "round_robin")
    assert stream["matched_bytes"] == 4 and stream["stream"] is True
    assert stream["slo"] == "relaxed" and stream["retries"] == 0
    assert stream["upstream_status"] == 200
    assert 0 < stream["ttft_ms"] <= stream["duration_ms"]
    assert plain["request_id"] == "plain-1" and plain["slo"] == "chat"
    assert plain["engine"] == "e0" and plain["stream"] is False and plain["ttft_ms"] is None
    assert retried["retries"] == 1 and retried["engine"] == "e0"
    assert retried["failed_engines"] == ["e1"] and retried["upstream_error"] == "http_500"
    assert retried["status"] == 200 and retried["upstream_status"] == 200
    assert shed["status"] == 429 and shed["reason"] == "shed" and shed["engine"] is None
    assert shed["detail"] == "test shed" and shed["upstream_status"] is None
    assert unknown["status"] == 404 and unknown["engine"] is None
    summary = explain(orjson.dumps(line).decode() for line in lines)
    assert summary["requests"] == 5
    assert summary["engines"]["e0"]["requests"] == 2
    assert summary["engines"]["e0"]["retried"] == 1
    assert summary["engines"]["e1"]["reasons"] == {"list/round_robin": 1}
    assert summary["decisions"]["list/shed"] == 1
    assert summary["statuses"] == {"200": 3, "404": 1, "429": 1}


async def test_no_access_log_means_no_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    cfg = GatewayConfig(access_log=False, health_interval_s=60)
    async with gateway_stack(1, cfg) as st, aiohttp.ClientSession() as s:
        assert await post(s, st.url + C, {"model": MODEL, "prompt": "x"}) == 200
    assert access_lines(caplog) == []


def test_the_fast_path_writes_one_json_line_to_the_log_stream() -> None:
    """With setup_logging's JSON handler alone on the root logger, a line skips LogRecord and
    formatter but reads the same: ts, level, logger, msg, request_id and the fields."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, kvlogs._json_handler)
    try:
        setup_logging("info")
        stream = io.StringIO()
        kvlogs._json_handler.stream = stream
        token = kvlogs.request_id_var.set("rid-9")
        AccessLog().write({"path": C, "status": 200, "engine": "e3", "matched_bytes": 512})
        kvlogs.request_id_var.reset(token)
        logging.getLogger(ACCESS_LOGGER).setLevel(logging.WARNING)
        alog = AccessLog()
        assert not alog.enabled()  # the level still rules (the gateway checks before writing)
        logging.getLogger(ACCESS_LOGGER).setLevel(logging.NOTSET)
    finally:
        root.handlers[:], level, kvlogs._json_handler = saved
        root.setLevel(level)
    (line,) = stream.getvalue().splitlines()
    rec = orjson.loads(line)
    assert rec["logger"] == ACCESS_LOGGER and rec["msg"] == "request" and rec["level"] == "info"
    assert rec["request_id"] == "rid-9" and rec["engine"] == "e3" and rec["matched_bytes"] == 512
    assert isinstance(rec["ts"], float)


def test_logs_explain_command(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        {"msg": "gateway listening", "logger": "kvgate.gateway"},  # not an access line
        *(
            {
                "msg": "request",
                "status": 200,
                "engine": f"e{i % 2}",
                "policy": "e2",
                "reason": "exploit" if i % 3 else "explore",
                "matched_bytes": 1024 * (i % 3),
                "slo": "chat",
                "retries": 1 if i == 5 else 0,
                "ttft_ms": 10.0 + i,
                "duration_ms": 20.0 + i,
            }
            for i in range(12)
        ),
    ]
    log = tmp_path / "gateway.log"
    log.write_text("\n".join(orjson.dumps(x).decode() for x in lines) + "\nnot json at all\n")
    assert kvgate_main(["logs", "explain", "--json", str(log)]) == 0
    summary = orjson.loads(capsys.readouterr().out)
    assert summary["requests"] == 12 and summary["other_lines"] == 1
    assert summary["skipped_lines"] == 1
    e0, e1 = summary["engines"]["e0"], summary["engines"]["e1"]
    assert e0["share"] == 0.5 and e1["share"] == 0.5 and e1["retried"] == 1
    assert e0["reasons"] == {"e2/exploit": 4, "e2/explore": 2}
    assert summary["decisions"] == {"e2/exploit": 8, "e2/explore": 4}
    assert e0["ttft_ms"]["p50"] == 15.0  # e0 served i = 0, 2, ..., 10
    assert kvgate_main(["logs", "explain", str(log)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("12 requests") and "e2/exploit" in text and "50.0%" in text
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert kvgate_main(["logs", "explain", str(empty)]) == 1  # nothing to explain
    assert kvgate_main(["logs", "explain", str(tmp_path / "missing.log")]) == 2


def test_log_lines_survive_odd_text() -> None:
    """A string orjson refuses (a lone surrogate: an odd header byte decoded with surrogate
    escapes) is written escaped; the line is not lost and the caller sees no exception."""
    odd = b"\xffabc".decode("utf-8", "surrogateescape")
    record = logging.LogRecord("kvgate.x", logging.WARNING, __file__, 1, "seen %s", (odd,), None)
    record.engine = odd  # an ``extra`` field
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, kvlogs._json_handler)
    token = kvlogs.request_id_var.set(odd)
    try:
        line = orjson.loads(JsonFormatter().format(record))
        assert line["msg"] == "seen \\udcffabc" and line["engine"] == "\\udcffabc"
        assert line["request_id"] == "\\udcffabc"
        setup_logging("info")
        stream = io.StringIO()
        kvlogs._json_handler.stream = stream
        AccessLog().write({"path": C, "status": 200, "model": odd})
    finally:
        kvlogs.request_id_var.reset(token)
        root.handlers[:], level, kvlogs._json_handler = saved
        root.setLevel(level)
    written = orjson.loads(stream.getvalue())
    assert written["model"] == "\\udcffabc" and written["request_id"] == "\\udcffabc"


def test_explain_hints_where_the_access_log_is_when_it_finds_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A gateway's stdout redirected to a file holds no access log (it is on stderr): the
    summary of 0 requests now says where to look."""
    log = tmp_path / "gateway.log"
    log.write_text('{"msg": "gateway listening", "level": "info"}\nplain text\n')
    assert kvgate_main(["logs", "explain", str(log)]) == 1
    err = capsys.readouterr().err
    assert "no access-log record" in err and "2> gateway.log" in err
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert kvgate_main(["logs", "explain", str(empty)]) == 1
    assert capsys.readouterr().err == ""  # nothing read: nothing to hint about
