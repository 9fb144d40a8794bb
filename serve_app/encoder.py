"""AudioEncoder deployment (CPU): per stream, resample the engine's audio and encode it.

It calls the synthesizer with ``.options(stream=True)`` and sends bytes on as soon as each
chunk is encoded, so the GPU replicas never spend time on codecs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.audio import StreamEncoder
from serve_app.errors import ApiError
from serve_app.hops import HOP_MARGIN_S, relay_error, within
from serve_app.logs import use_replica_log
from serve_app.messages import EncodedChunk, EncodeJob, StreamUsage, TextInputOpen
from serve_app.metrics import EncoderMetrics

logger = logging.getLogger(__name__)


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
                     ) -> AsyncIterator[bytes | EncodedChunk | StreamUsage | TextInputOpen | ApiError]:
        """Encoded bytes of one stream (with ``job.events``: an EncodedChunk per engine chunk,
        then the StreamUsage); a rejected or failed stream ends with an ApiError."""
        started_s = time.perf_counter()
        audio_s = 0.0
        request_id = job.request.request_id
        chunks = self._synthesizer.synthesize.options(stream=True).remote(job.request)
        encoder: StreamEncoder | None = None
        usage: StreamUsage | None = None
        finished = False
        try:
            async for item in within(chunks, self._first_chunk_timeout_s, self._chunk_timeout_s):
                if isinstance(item, ApiError):
                    finished = True
                    yield item
                    return
                if isinstance(item, StreamUsage):
                    usage = item  # sent after the encoder's tail: it closes the stream
                    continue
                if isinstance(item, TextInputOpen):
                    yield item  # the caller feeds the stream's text to that replica
                    continue
                if encoder is None:
                    encoder = StreamEncoder(job.audio_format, item.sample_rate_hz,
                                            job.sample_rate_hz)
                # Codecs take milliseconds per chunk; they run in a worker thread so the event
                # loop stays free for other streams. Raw samples are cast here, sparing the
                # thread handoff on every chunk's path.
                encode_started_s = time.perf_counter()
                data = (encoder.encode(item.samples) if encoder.light
                        else await asyncio.to_thread(encoder.encode, item.samples))
                self._metrics.chunk(item.timings_s, time.perf_counter() - encode_started_s)
                if job.events:
                    yield EncodedChunk(data, item.text, audio_s, item.duration_s, item.timings_s)
                elif data:
                    yield data
                audio_s += item.duration_s
            if encoder is not None:
                tail = (encoder.finish() if encoder.light
                        else await asyncio.to_thread(encoder.finish))
                if tail:
                    yield EncodedChunk(tail, "", audio_s, 0.0) if job.events else tail
            if job.events and usage is not None:
                yield usage
            finished = True
            self._metrics.stream_finished(job.audio_format, audio_s,
                                          time.perf_counter() - started_s)
        except Exception as exc:
            yield relay_error(request_id, "the synthesizer", exc)
        finally:
            if not finished:
                # Our caller went away, or the synthesizer failed: stop its stream too (the
                # synthesizer then aborts the engine stream).
                chunks.cancel()
