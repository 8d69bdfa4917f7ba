"""kvgate's benchmarks: trace replay, the cluster simulator, the routing matrix, reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson


def read_json(path: str | Path) -> Any:
    """The JSON document at ``path``; ValueError naming the file when it is not JSON (orjson's
    message alone does not say which of several inputs was bad)."""
    data = Path(path).read_bytes()
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a JSON document ({exc})") from None
