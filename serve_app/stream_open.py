"""Opening an encoder stream for a reply: the first item decides between audio and an error.

Shared by the HTTP routes (audio bytes, SSE) and the WebSocket route, so every reply maps a
rejection, an overload or a timeout before the first item to the same :class:`ApiError`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from serve_app.config import HOP_MARGIN_S, ApiConfig
from serve_app.errors import ApiError
from serve_app.guard import RETRY_AFTER, TimedPieces
from serve_app.messages import EncodeJob, StreamError

logger = logging.getLogger(__name__)


async def open_stream(encoder: DeploymentHandle, job: EncodeJob, api: ApiConfig,
                      started_s: float) -> tuple[Any, TimedPieces]:
    """Start ``job`` on the encoder and wait for its first item (``b""`` if it sent none).

    Raises :class:`ApiError` when the stream was refused or failed before its first item; the
    rest comes as :class:`TimedPieces` (per-piece timeout, wall-clock limit from ``started_s``).
    """
    request_id = job.request.request_id
    pieces = encoder.stream.options(stream=True).remote(job)
    first_timeout_s = api.first_chunk_timeout_s + 2 * HOP_MARGIN_S
    try:
        # The first item tells rejection (StreamError) from audio, so the status is right.
        first = await asyncio.wait_for(pieces.__anext__(), first_timeout_s)
    except StopAsyncIteration:
        first = b""
    except BackPressureError:
        raise ApiError(503, "the service is at capacity; retry shortly", code="overloaded",
                       error_type="service_unavailable", headers=RETRY_AFTER)
    except TimeoutError:
        pieces.cancel()
        logger.error("request %s: no audio within %g s", request_id, first_timeout_s)
        raise ApiError(504, "speech synthesis timed out", code="timeout",
                       error_type="server_error") from None
    except Exception as exc:
        pieces.cancel()
        logger.error("request %s: encoder stream failed (%s)", request_id, type(exc).__name__)
        raise ApiError(503, "speech synthesis failed; retry shortly",
                       code="synthesis_unavailable", headers=RETRY_AFTER) from None
    except BaseException:
        pieces.cancel()
        raise
    if isinstance(first, StreamError):
        raise ApiError(first.status_code, first.message, param=first.param, code=first.code,
                       error_type=first.type,
                       headers=RETRY_AFTER if first.status_code == 503 else None)
    timed = TimedPieces(pieces, request_id, api.chunk_timeout_s + 2 * HOP_MARGIN_S,
                        api.max_stream_s, started_s)
    return first, timed
