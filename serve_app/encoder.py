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
from serve_app.messages import EncodeJob, StreamError
from serve_app.metrics import EncoderMetrics

logger = logging.getLogger(__name__)


@serve.deployment(name="AudioEncoder", max_ongoing_requests=256,
                  ray_actor_options={"num_cpus": 0.25})
class AudioEncoder:
    def __init__(self, synthesizer: DeploymentHandle) -> None:
        self._synthesizer = synthesizer
        self._metrics = EncoderMetrics()

    async def stream(self, job: EncodeJob) -> AsyncIterator[bytes | StreamError]:
        """Encoded bytes of one stream; a rejected stream yields a single StreamError."""
        started_s = time.perf_counter()
        audio_s = 0.0
        chunks = self._synthesizer.synthesize.options(stream=True).remote(job.request)
        encoder: StreamEncoder | None = None
        finished = False
        try:
            async for item in chunks:
                if isinstance(item, StreamError):
                    finished = True
                    yield item
                    return
                if encoder is None:
                    encoder = StreamEncoder(job.audio_format, item.sample_rate_hz,
                                            job.sample_rate_hz)
                # Codecs take milliseconds per chunk; keep the event loop free for other streams.
                encode_started_s = time.perf_counter()
                data = await asyncio.to_thread(encoder.encode, item.samples)
                self._metrics.chunk(item.timings_s, time.perf_counter() - encode_started_s)
                audio_s += item.duration_s
                if data:
                    yield data
            if encoder is not None:
                tail = await asyncio.to_thread(encoder.finish)
                if tail:
                    yield tail
            finished = True
            self._metrics.stream_finished(job.audio_format, audio_s,
                                          time.perf_counter() - started_s)
        finally:
            if not finished:
                # Our caller went away: stop the synthesizer stream too (it aborts the engine).
                chunks.cancel()
