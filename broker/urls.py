"""Which broker URLs kvgate can open, checked before anything starts.

:func:`broker.connect` opens Redis lazily, so a URL it cannot use would otherwise surface as a
traceback from deep inside the first connection (or, for a database that is not a number,
silently as database 0). The check here is the one home of what a good URL is: every command
taking ``--broker`` (or ``kvgate up --redis-url``) runs it while parsing its arguments.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

MEMORY_SCHEMES = ("memory",)
REDIS_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
FORMS = {
    "memory": "memory://",
    "redis": "redis[s]://[[USER]:PASSWORD@]HOST[:PORT][/DB], unix://PATH",
    "sentinel": "redis[s]+sentinel://HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB]",
}


def check_broker_url(url: str, *, memory: bool = True, sentinel: bool = True) -> str:
    """``url`` when kvgate can open a broker on it, else ValueError saying why and which forms
    are wanted; ``memory``/``sentinel``: whether those kinds are accepted here."""
    kinds = ["redis", *(["memory"] * memory), *(["sentinel"] * sentinel)]
    wanted = "; ".join(FORMS[k] for k in ("memory", "redis", "sentinel") if k in kinds)
    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if memory and (url == "memory://" or url.startswith("memory:")):
        return url
    if not sep:
        raise ValueError(f"{url!r} is not a broker URL: want {wanted}")
    if scheme not in REDIS_SCHEMES + (SENTINEL_SCHEMES if sentinel else ()):
        raise ValueError(f"{url!r}: unsupported scheme {scheme}://, want {wanted}")
    if scheme in SENTINEL_SCHEMES:
        from broker.redis_broker import parse_sentinel_url  # (imports redis: only when needed)

        try:
            parse_sentinel_url(url)
        except ValueError as exc:
            raise ValueError(
                f"bad sentinel URL {url!r} ({exc}): want {FORMS['sentinel']}"
            ) from None
        return url
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a port that is not a number 0-65535)
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"{url!r}: a unix:// URL needs the socket's path")
        return url
    db = unquote(parts.path).strip("/")
    if db and not db.isdigit():
        raise ValueError(f"{url!r}: the database {db!r} is not a number")
    return url
