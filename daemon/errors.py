"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status."""

from __future__ import annotations

import msgspec
from aiohttp import web

from tokenloom.daemon.openai.responses import ErrorDetail, ErrorResponse

# Status -> the error `type` OpenAI's API reports for it (4xx not listed: invalid_request_error).
_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}
_CODES = {413: "request_too_large", 415: "unsupported_media_type", 429: "server_overloaded",
          503: "service_unavailable"}


class APIError(Exception):
    """An error that ends one HTTP request; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status)
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500
                                       else "server_error")
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type,
                                               param=self.param, code=self.code))

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=self.headers)
