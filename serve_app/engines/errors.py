"""The errors an engine raises, in a leaf module: the engines, the text rule and the front
import them without importing anything else (:mod:`serve_app.engines.base` re-exports them).
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """A failure inside the engine while serving a request (not the caller's fault)."""


class InvalidRequestError(ValueError):
    """The caller asked for something the engine cannot do; maps to a 4xx reply.

    ``param`` names the offending request field, ``code`` is a short machine-readable reason.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request",
                 status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code

    def __reduce__(self) -> tuple:  # keeps param and code across processes
        return (type(self), (self.message, self.param, self.code, self.status_code))


class EngineOverloadedError(EngineError):
    """The engine cannot take the request now; maps to 503 with Retry-After. ``reason`` says
    why: ``queue`` (its queue is full, or would start it too late), ``work`` (its real-time
    budget is full), ``wait`` (it waited past its first audio's deadline), ``voices`` (every
    loaded voice is held); see :mod:`serve_app.engines.work_admission`."""

    def __init__(self, message: str, reason: str = "queue") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason

    def __reduce__(self) -> tuple:  # keeps the reason across processes
        return (type(self), (self.message, self.reason))


class RequestAbortedError(EngineError):
    """The stream was aborted (client gone, shutdown) before it finished."""
