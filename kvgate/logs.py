"""Structured JSON logs with a request id, 'log once' for noisy repeated problems, and the
access log (one JSON line per request; ``kvgate logs explain`` summarises it)."""

from __future__ import annotations

import argparse
import contextvars
import logging
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import orjson

from kvgate.stats import percentile

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvgate_request_id", default=None
)


def _printable(value: Any) -> Any:
    """``value`` with every string made encodable (a lone surrogate, such as a header's odd
    byte decoded with surrogate escapes, written as its backslash escape); the rest as is."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable(v) for v in value]
    return value


def json_line(fields: dict[str, Any]) -> str:
    """One JSON log line. Never fails on odd text: orjson refuses strings holding lone
    surrogates (a log line lost, or an exception in the request that logs), so such strings
    are escaped and the line encoded again (only then: the common line pays nothing)."""
    try:
        return orjson.dumps(fields, default=str).decode()
    except TypeError:  # (orjson.JSONEncodeError is one)
        return orjson.dumps(_printable(fields), default=lambda v: _printable(str(v))).decode()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id, and any ``extra`` fields."""

    _skip = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid is not None:
            out["request_id"] = rid
        for k, v in record.__dict__.items():
            if k not in self._skip and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json_line(out)


_json_handler: logging.StreamHandler | None = None  # the handler setup_logging installed


def setup_logging(level: str = "info", json_format: bool = True) -> None:
    """Configure the root logger once for a kvgate process."""
    global _json_handler
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _json_handler = handler if json_format else None
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


ACCESS_LOGGER = "kvgate.access"
ACCESS_MSG = "request"


class AccessLog:
    """The access log: one JSON line per request, ``msg`` "request", on the ``kvgate.access``
    logger, with the fields the caller gives (docs/gateway.md lists the gateway's).

    Cheap: when the process logs JSON through :func:`setup_logging`'s handler alone, a line is
    one orjson encoding written straight to that handler's stream (about 2 us, against 8 us for
    a ``LogRecord`` through the formatter: measured). Otherwise (tests, a process embedding
    kvgate with handlers of its own) it is an ordinary log record, so those handlers see it."""

    def __init__(self) -> None:
        self.logger = logging.getLogger(ACCESS_LOGGER)

    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)

    def write(self, fields: dict[str, Any]) -> None:
        handler = _json_handler
        logger = self.logger
        rid = request_id_var.get()
        if handler is None or logger.handlers or logging.root.handlers != [handler]:
            logger.info(ACCESS_MSG, extra={"request_id": rid, **fields})
            return
        out: dict[str, Any] = {
            "ts": round(time.time(), 6),
            "level": "info",
            "logger": ACCESS_LOGGER,
            "msg": ACCESS_MSG,
            "request_id": rid,
        }
        out.update(fields)
        line = json_line(out) + "\n"
        handler.acquire()
        try:
            handler.stream.write(line)
            handler.stream.flush()
        except Exception:
            handler.handleError(logging.makeLogRecord({"msg": ACCESS_MSG}))
        finally:
            handler.release()


class LogOnce:
    """Log a problem the first time per key (e.g. per engine), then only count it."""

    def __init__(self, logger: logging.Logger, every_s: float = 300.0) -> None:
        self._logger = logger
        self._every_s = every_s
        self._last: dict[str, float] = {}

    def warning(self, key: str, msg: str, *args: object) -> bool:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._every_s:
            return False
        self._last[key] = now
        self._logger.warning(msg, *args)
        return True


# ---- kvgate logs explain ----------------------------------------------------------------------


def access_records(lines: Iterable[str], stats: Counter[str] | None = None) -> Iterator[dict]:
    """The access-log records among JSON log lines (other log lines are passed over; lines
    that are not JSON objects are counted in ``stats["skipped"]``)."""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            if stats is not None:
                stats["skipped"] += 1
            continue
        if not isinstance(rec, dict):
            if stats is not None:
                stats["skipped"] += 1
        elif rec.get("msg") == ACCESS_MSG and "status" in rec:
            yield rec
        elif stats is not None:
            stats["other"] += 1


def _ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": round(percentile(values, 0.5), 3), "p99": round(percentile(values, 0.99), 3)}


def explain(lines: Iterable[str]) -> dict[str, Any]:
    """Summarise an access log: per engine its share of requests, the reasons it was chosen,
    statuses, retries, matched bytes and times; per policy and reason; per SLO class."""
    stats: Counter[str] = Counter()
    engines: dict[str, dict[str, Any]] = defaultdict(
        lambda: {
            "requests": 0,
            "reasons": Counter(),
            "statuses": Counter(),
            "retried": 0,
            "matched_bytes": 0,
            "ttft_ms": [],
            "duration_ms": [],
        }
    )
    decisions: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    slo: Counter[str] = Counter()
    total = 0
    for rec in access_records(lines, stats):
        total += 1
        engine = rec.get("engine") or "(none)"
        reason = f"{rec.get('policy') or '-'}/{rec.get('reason') or '-'}"
        status = str(rec.get("status"))
        e = engines[str(engine)]
        e["requests"] += 1
        e["reasons"][reason] += 1
        e["statuses"][status] += 1
        retries = rec.get("retries")
        if isinstance(retries, int) and retries > 0:
            e["retried"] += 1
        matched = rec.get("matched_bytes")
        if isinstance(matched, (int, float)):
            e["matched_bytes"] += matched
        for key in ("ttft_ms", "duration_ms"):
            value = rec.get(key)
            if isinstance(value, (int, float)):
                e[key].append(float(value))
        decisions[reason] += 1
        statuses[status] += 1
        slo[str(rec.get("slo") or "-")] += 1
    per_engine = {}
    for name, e in sorted(engines.items(), key=lambda kv: -kv[1]["requests"]):
        n = e["requests"]
        per_engine[name] = {
            "requests": n,
            "share": round(n / total, 4) if total else 0.0,
            "reasons": dict(e["reasons"].most_common()),
            "statuses": dict(sorted(e["statuses"].items())),
            "retried": e["retried"],
            "mean_matched_bytes": round(e["matched_bytes"] / n, 1) if n else 0.0,
            "ttft_ms": _ms(e["ttft_ms"]),
            "duration_ms": _ms(e["duration_ms"]),
        }
    return {
        "requests": total,
        "engines": per_engine,
        "decisions": dict(decisions.most_common()),
        "statuses": dict(sorted(statuses.items())),
        "slo_classes": dict(slo.most_common()),
        "other_lines": stats["other"],
        "skipped_lines": stats["skipped"],
    }


def format_explain(summary: dict[str, Any]) -> str:
    """The summary as a few plain-text tables."""

    def ms(d: dict[str, float | None]) -> str:
        return "-" if d["p50"] is None else f"{d['p50']:.1f} / {d['p99']:.1f}"

    total = summary["requests"]
    out = [f"{total} requests"]
    if summary["skipped_lines"]:
        out[0] += f" ({summary['skipped_lines']} lines were not JSON and were skipped)"
    out.append("")
    out.append(
        f"{'engine':<24} {'requests':>8} {'share':>7} {'retried':>7} {'matched B':>10} "
        f"{'TTFT p50/p99 ms':>17} {'total p50/p99 ms':>18}  reasons"
    )
    for name, e in summary["engines"].items():
        reasons = ", ".join(f"{r} {c}" for r, c in e["reasons"].items())
        out.append(
            f"{name:<24} {e['requests']:>8} {e['share'] * 100:>6.1f}% {e['retried']:>7} "
            f"{e['mean_matched_bytes']:>10.0f} {ms(e['ttft_ms']):>17} "
            f"{ms(e['duration_ms']):>18}  {reasons}"
        )
    for title, key in (
        ("policy/reason", "decisions"),
        ("status", "statuses"),
        ("SLO class", "slo_classes"),
    ):
        out.append("")
        out.append(f"{title:<24} {'requests':>8} {'share':>7}")
        for name, n in summary[key].items():
            share = n / total * 100 if total else 0.0
            out.append(f"{name:<24} {n:>8} {share:>6.1f}%")
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    p = sub.add_parser(
        "explain",
        help="summarise an access log: per-engine shares, policies and reasons",
        description="Summarise the gateway's access log (JSON lines; other log lines are "
        "passed over): per engine its share of requests and why it was chosen, statuses, "
        "retries, matched bytes, TTFT and total time; per policy/reason; per SLO class.",
    )
    p.add_argument("files", nargs="*", type=Path, help="log files (default: standard input)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _lines(files: list[Path], stdin: TextIO) -> Iterator[str]:
    if not files:
        yield from stdin
        return
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            yield from fh


def run(args: argparse.Namespace) -> int:
    try:
        summary = explain(_lines(args.files, sys.stdin))
    except OSError as exc:
        print(f"kvgate logs explain: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    else:
        print(format_explain(summary))
    if not summary["requests"] and summary["other_lines"] + summary["skipped_lines"]:
        print(NO_RECORDS_HINT, file=sys.stderr)
    return 0 if summary["requests"] else 1


# Why lines without a record are the usual surprise: ``kvgate gateway ... > gateway.log``.
NO_RECORDS_HINT = (
    "kvgate logs explain: no access-log record in this input: the gateway writes its access "
    "log to standard error (kvgate gateway ... 2> gateway.log), unless --no-access-log"
)
