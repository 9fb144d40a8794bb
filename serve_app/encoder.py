"""AudioEncoder deployment (CPU): per stream, resample the engine's audio and encode it.

It calls the synthesizer with ``.options(stream=True)`` and sends bytes on as soon as each
chunk is encoded, so the GPU replicas never spend time on codecs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from serve_app.audio import StreamEncoder
from serve_app.config import HOP_MARGIN_S
from serve_app.logs import use_replica_log
from serve_app.messages import (
    EncodedChunk,
    EncodeJob,
    StreamError,
    StreamUsage,
    TextInputOpen,
)
from serve_app.metrics import EncoderMetrics

logger = logging.getLogger(__name__)


def _upstream_error(request_id: str, exc: BaseException) -> StreamError:
    if isinstance(exc, BackPressureError):
        return StreamError(message="the service is at capacity; retry shortly", status_code=503,
                           code="overloaded", type="service_unavailable")
    if isinstance(exc, TimeoutError):
        logger.error("request %s: synthesizer sent nothing in time", request_id)
        return StreamError(message="speech synthesis timed out", status_code=504,
                           code="timeout", type="server_error")
    # A dead synthesizer replica (RayActorError) lands here too; Serve restarts it.
    logger.error("request %s: synthesizer stream failed (%s)", request_id, type(exc).__name__)
    return StreamError(message="speech synthesis failed; retry shortly", status_code=503,
                       code="synthesis_unavailable", type="service_unavailable")


@serve.deployment(name="AudioEncoder", max_ongoing_requests=256, max_queued_requests=256,
                  graceful_shutdown_timeout_s=90, ray_actor_options={"num_cpus": 0.25})
class AudioEncoder:
    def __init__(self, synthesizer: DeploymentHandle, first_chunk_timeout_s: float = 60.0,
                 chunk_timeout_s: float = 30.0) -> None:
        use_replica_log()
        self._synthesizer = synthesizer
        self._metrics = EncoderMetrics()
        self._first_chunk_timeout_s = first_chunk_timeout_s + HOP_MARGIN_S
        self._chunk_timeout_s = chunk_timeout_s + HOP_MARGIN_S

    async def stream(self, job: EncodeJob
                     ) -> AsyncIterator[bytes | EncodedChunk | StreamUsage | StreamError]:
        """Encoded bytes of one stream (with ``job.events``: an EncodedChunk per engine chunk,
        then the StreamUsage); a rejected or failed stream ends with a StreamError."""
        started_s = time.perf_counter()
        audio_s = 0.0
        chunks = self._synthesizer.synthesize.options(stream=True).remote(job.request)
        encoder: StreamEncoder | None = None
        usage: StreamUsage | None = None
        finished = False
        try:
            async for item in self._items(chunks, job.request.request_id):
                if isinstance(item, StreamError):
                    finished = True
                    yield item
                    return
                if isinstance(item, StreamUsage):
                    usage = item  # sent after the encoder's tail: it closes the stream
                    continue
                if isinstance(item, TextInputOpen):
                    yield item  # the caller feeds the stream's text to this replica
                    continue
                if encoder is None:
                    encoder = StreamEncoder(job.audio_format, item.sample_rate_hz,
                                            job.sample_rate_hz)
                # Codecs take milliseconds per chunk; keep the event loop free for other streams.
                encode_started_s = time.perf_counter()
                data = await asyncio.to_thread(encoder.encode, item.samples)
                self._metrics.chunk(item.timings_s, time.perf_counter() - encode_started_s)
                if job.events:
                    yield EncodedChunk(data, item.text, audio_s, item.duration_s, item.timings_s)
                elif data:
                    yield data
                audio_s += item.duration_s
            if encoder is not None:
                tail = await asyncio.to_thread(encoder.finish)
                if tail:
                    yield EncodedChunk(tail, "", audio_s, 0.0) if job.events else tail
            if job.events and usage is not None:
                yield usage
            finished = True
            self._metrics.stream_finished(job.audio_format, audio_s,
                                          time.perf_counter() - started_s)
        finally:
            if not finished:
                # Our caller went away: stop the synthesizer stream too (it aborts the engine).
                chunks.cancel()

    async def _items(self, chunks: Any, request_id: str) -> AsyncIterator[Any]:
        """The synthesizer's items, each within its timeout; a failure becomes a StreamError."""
        timeout_s = self._first_chunk_timeout_s
        while True:
            try:
                item = await asyncio.wait_for(chunks.__anext__(), timeout_s)
            except StopAsyncIteration:
                return
            except Exception as exc:
                chunks.cancel()
                yield _upstream_error(request_id, exc)
                return
            timeout_s = self._chunk_timeout_s
            yield item
