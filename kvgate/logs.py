"""Structured JSON logs with a request id, and 'log once' for noisy repeated problems."""

from __future__ import annotations

import contextvars
import logging
import sys
import time

import orjson

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvgate_request_id", default=None
)


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
        return orjson.dumps(out, default=str).decode()


def setup_logging(level: str = "info", json_format: bool = True) -> None:
    """Configure the root logger once for a kvgate process."""
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


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
