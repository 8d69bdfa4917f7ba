"""OpenAI-style JSON error responses: the one way the gateway says no."""

from __future__ import annotations

import orjson

from gateway.httpserver import Response, json_response
from kvgate.openai_request import RequestError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",  # (the client's head or body came too slowly)
    413: "invalid_request_error",
    415: "invalid_request_error",
    417: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    501: "invalid_request_error",  # (a transfer coding the server does not take)
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
    505: "invalid_request_error",
}


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """A JSON error body shaped as OpenAI's, which the openai SDK turns into its exceptions."""
    err = RequestError(
        message,
        status=status,
        param=param,
        code=code,
        type_=ERROR_TYPES.get(status, "api_error"),
    )
    return from_request_error(err, headers)


def from_request_error(err: RequestError, headers: dict[str, str] | None = None) -> Response:
    return json_response(orjson.dumps(err.to_body()), err.status, (headers or {}).items())
