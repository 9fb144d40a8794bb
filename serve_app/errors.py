"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Errors are raised where detected and turned into HTTP here, once; nothing below ever carries a
traceback, a file path or a secret.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error the ingress answers with; ``status_code`` is the HTTP status."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES_BY_STATUS.get(
            status_code, "server_error" if status_code >= 500 else "invalid_request_error")
        self.headers = headers


def error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.error_type, "param": error.param,
                      "code": error.code}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status_code, headers=error.headers)
