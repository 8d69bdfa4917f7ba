"""What every ``kvgate`` command shares about bad input: argument types and error exits.

One home, so that the same mistake gets the same one-line error (``PROG: error: ...``, exit 2,
argparse's own form) from every command, never a traceback: a port out of range is refused
while the arguments are parsed, a port already taken when the server binds it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from kvgate.openai_request import ChatTemplate

USAGE_ERROR = 2  # argparse's exit status for bad arguments; every command uses it


def usage_error(prog: str, message: str) -> int:
    """Print ``PROG: error: MESSAGE`` on stderr, as argparse does; the exit status (2)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def port(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"want a port number 0-65535, got {text!r}")
    return value


def _number(text: str, cast: type, ok: str, test) -> float:
    try:
        value = cast(text)
    except ValueError:
        value = None
    if value is None or value != value or not test(value):  # (value != value: NaN)
        kind = "an integer" if cast is int else "a number"
        raise argparse.ArgumentTypeError(f"want {kind} {ok}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a count: engines, requests)."""
    return int(_number(text, int, ">= 1", lambda v: v >= 1))


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (a rate, a length of time)."""
    return _number(text, float, "> 0", lambda v: 0 < v < float("inf"))


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0 (a start time, a delay)."""
    return _number(text, float, ">= 0", lambda v: 0 <= v < float("inf"))


def check_http_url(url: str, what: str = "") -> str:
    """``url`` without a trailing slash if it is an http(s) URL with a host and a valid port,
    else ValueError naming ``what`` (the flag): a server given ``notaurl`` would otherwise
    start and answer 503 forever, a client exit 0 having sent nothing."""
    parts = urlsplit(url)
    bad = f"{what}: " * bool(what) + f"{url!r} is not an http(s) URL"
    try:
        parts.port  # noqa: B018 (raises ValueError on a port that is not a number 0-65535)
    except ValueError as exc:
        raise ValueError(f"{bad} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{bad} (want http(s)://HOST[:PORT])")
    return url.rstrip("/")


def http_url(text: str) -> str:
    """argparse type: an http(s) base URL (:func:`check_http_url`)."""
    try:
        return check_http_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def broker_url(text: str) -> str:
    """argparse type: a broker URL kvgate can open (:func:`broker.urls.check_broker_url`)."""
    from broker.urls import check_broker_url

    try:
        return check_broker_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def redis_url(text: str) -> str:
    """argparse type: a plain Redis URL (redis://, rediss://, unix://; no memory, no Sentinel)."""
    from broker.urls import check_broker_url

    try:
        return check_broker_url(text, memory=False, sentinel=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_chat_template(path: str, flag: str = "--chat-template") -> ChatTemplate:
    """The chat template at ``path`` (a model folder or a .jinja file); a missing or unreadable
    one is a ValueError naming the flag and the path, checked before a server starts."""
    from kvgate.openai_request import ChatTemplate

    try:
        return ChatTemplate.from_path(path)
    except (OSError, ValueError) as exc:  # (a JSON or Jinja syntax error is a ValueError)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"{flag} {path}: {reason}") from None


class ListenError(Exception):
    """A server could not bind its address (taken, out of range, not local): the user's to
    fix, so it is reported in one line, not as a traceback."""


@contextmanager
def listening(host: str, port: int) -> Iterator[None]:
    """Turn a failure to bind ``host:port`` inside the block into :class:`ListenError`."""
    try:
        yield
    except (OSError, OverflowError) as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc}") from exc
