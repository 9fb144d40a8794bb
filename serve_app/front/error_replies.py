"""Every error the front answers leaves as OpenAI-style JSON: the app's exception handlers, and
the mapping of FastAPI's validation and HTTP errors (a missing field, bad JSON, an unknown
route) onto :class:`~serve_app.errors.ApiError`."""

# No `from __future__ import annotations`: FastAPI reads the handlers' signatures.
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import errors
from serve_app.errors import ApiError
from serve_app.front.guard import JSON_MEDIA_TYPE, json_error

logger = logging.getLogger("serve_app.front.ingress")  # the ingress's log, as before the split


def validation_error(exc: RequestValidationError) -> ApiError:
    """A body FastAPI could not validate, as the 400 naming its first problem."""
    problems = exc.errors()
    first = problems[0] if problems else {}
    if first.get("type") == "json_invalid":
        return errors.invalid_json()
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        return ApiError(400, f"missing required parameter: {param}", param=param,
                        code="missing_required_parameter")
    if first.get("type") == "model_attributes_type":
        return errors.invalid_json("request body must be a JSON object")
    return ApiError(400, f"invalid value for {param}: {message}" if param else message,
                    param=param, code="invalid_value")


def unparsable_json(request: Request, exc: StarletteHTTPException) -> str | None:
    """What kept FastAPI from parsing a JSON body, when that is what ``exc`` (its 400 "There was
    an error parsing the body", raised from the parser's own error) says: bad UTF-8, or nesting
    deeper than the parser recurses (a JSON syntax error is a RequestValidationError instead)."""
    if exc.status_code != 400 or request.headers.get("content-type", "").split(";")[0].strip(
            ).lower() != JSON_MEDIA_TYPE:
        return None
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return "request body is not valid UTF-8"
    if isinstance(cause, RecursionError):
        return "request body nests too deeply to parse"
    if isinstance(cause, ValueError):
        return "malformed JSON body"
    return None


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return json_error(exc, request.app.state)


async def _request_validation_error(request: Request,
                                    exc: RequestValidationError) -> JSONResponse:
    return json_error(validation_error(exc), request.app.state)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        error = ApiError(404, f"no route for {request.method} {request.url.path}",
                         code="not_found")
    elif exc.status_code == 405:
        error = ApiError(405, f"method {request.method} not allowed on {request.url.path}",
                         code="method_not_allowed")
    elif (body_problem := unparsable_json(request, exc)) is not None:
        error = errors.invalid_json(body_problem)
    else:
        error = ApiError(exc.status_code, str(exc.detail), code="http_error")
    return json_error(error, request.app.state)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in the ingress")
    return json_error(ApiError(500, "internal server error", code="internal_error"),
                      request.app.state)


def add_error_handlers(app: FastAPI) -> None:
    """Answer ``app``'s errors as JSON: ours (ApiError), FastAPI's validation errors, HTTP
    errors (404, 405, an unparsable body) and anything unexpected (a logged 500)."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
