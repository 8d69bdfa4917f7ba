"""``RemoteRouter``: the gateway's side of a remote ``kvgate router`` (implements
``router.api.RoutingService`` over HTTP with aiohttp, bounded by timeouts)."""

from __future__ import annotations

import aiohttp
import orjson

from router.api import Decision, EngineInfo, Outcome, RouteRequest
from router.wire import (
    WireError,
    decision_from_json,
    engine_from_json,
    first_token_to_json,
    report_to_json,
    request_to_json,
)


class RouterUnavailable(RuntimeError):
    """The remote router could not be reached or answered with an error."""


class RemoteRouter:
    """Talks to ``kvgate router`` at ``url`` (e.g. ``http://127.0.0.1:8400``)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 2.0,
        report_timeout_s: float = 1.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.report_timeout = aiohttp.ClientTimeout(total=report_timeout_s)
        self._session = session
        self._own_session = session is None

    async def start(self) -> None:
        self._get_session()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(json_serialize=lambda o: orjson.dumps(o).decode())
            self._own_session = True
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def _call(
        self, method: str, path: str, body: object | None, timeout: aiohttp.ClientTimeout
    ) -> object:
        session = self._get_session()
        data = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else None
        try:
            async with session.request(
                method, self.url + path, data=data, headers=headers, timeout=timeout
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise RouterUnavailable(
                        f"router {method} {path}: HTTP {resp.status}: {raw[:200]!r}"
                    )
                return orjson.loads(raw)
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
            raise RouterUnavailable(f"router {method} {path}: {exc!r}") from exc

    async def route(self, request: RouteRequest) -> Decision:
        body = await self._call("POST", "/route", request_to_json(request), self.timeout)
        try:
            return decision_from_json(body)
        except WireError as exc:
            raise RouterUnavailable(f"router sent a malformed decision: {exc}") from exc

    async def report(
        self,
        request_id: str,
        engine_id: str,
        outcome: Outcome,
        output_tokens: int = 0,
        max_tokens: int = 0,
    ) -> None:
        body = report_to_json(request_id, engine_id, outcome, output_tokens, max_tokens)
        await self._call("POST", "/report", body, self.report_timeout)

    async def first_token(self, request_id: str, engine_id: str, ttft_ms: float) -> None:
        body = first_token_to_json(request_id, engine_id, ttft_ms)
        await self._call("POST", "/first_token", body, self.report_timeout)

    async def ready(self) -> bool:
        """Whether the router answers ``GET /ready`` with 200 (caught up with its broker and
        knowing a live engine); False while it warms up or cannot be reached."""
        try:
            await self._call("GET", "/ready", None, self.report_timeout)
        except RouterUnavailable:
            return False
        return True

    async def engines(self) -> list[EngineInfo]:
        body = await self._call("GET", "/engines", None, self.timeout)
        if not isinstance(body, list):
            raise RouterUnavailable("router sent a malformed engine list")
        try:
            return [engine_from_json(e) for e in body]
        except WireError as exc:
            raise RouterUnavailable(str(exc)) from exc
