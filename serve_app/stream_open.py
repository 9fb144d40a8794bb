"""Opening a speech stream through the encoder, for the HTTP routes and the WebSocket alike.

The first item decides the outcome: an :class:`~serve_app.errors.ApiError` (refused or failed
before any audio) is raised, so the caller can still answer with the right status; anything else
is returned with the rest of the stream, each piece within its timeout (:mod:`serve_app.hops`).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serve_app.config import ApiConfig
from serve_app.errors import ApiError
from serve_app.hops import HOP_MARGIN_S, relay_error, within
from serve_app.messages import EncodeJob


async def open_stream(encoder: DeploymentHandle, job: EncodeJob, api: ApiConfig
                      ) -> tuple[Any, AsyncIterator[Any], DeploymentResponseGenerator]:
    """Start ``job`` on the encoder; returns its first item (``b""`` if it sent none), the rest
    (timed: per piece, and ``api.max_stream_s`` in all) and the upstream (to cancel)."""
    upstream: DeploymentResponseGenerator = encoder.stream.options(stream=True).remote(job)
    pieces = within(upstream, api.first_chunk_timeout_s + 2 * HOP_MARGIN_S,
                    api.chunk_timeout_s + 2 * HOP_MARGIN_S, api.max_stream_s)
    try:
        first = await anext(pieces)
    except StopAsyncIteration:
        first = b""
    except BaseException as exc:
        upstream.cancel()
        if isinstance(exc, Exception):
            raise relay_error(job.request.request_id, "the encoder", exc) from None
        raise
    if isinstance(first, ApiError):
        raise first
    return first, pieces, upstream
