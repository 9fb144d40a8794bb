"""Synthesizer deployment: owns the engine and admits requests into it in ``@serve.batch`` batches.

The engine runs in a process of its own (:mod:`serve_app.gpu.engine_process`), so nothing this
replica does for Ray and HTTP (relaying chunks, pickling them, metrics) competes with the
engine's step thread for the GIL; :class:`~serve_app.gpu.engine_client.EngineClient` is this side.

The jobs around the streams live beside this module: admission in batches
(:mod:`serve_app.gpu.admission`), cloned voices (:mod:`serve_app.gpu.replica_voices`), the text
of streamed-input requests, which comes through a Ray actor of this replica's, never through
Serve (:mod:`serve_app.gpu.text_inbox`), the engine's gauges, autoscaling signals and death
(:mod:`serve_app.gpu.engine_watch`).

A stream's usage is counted by its engine and comes on its final chunk; this replica relays it
after that chunk as a :class:`~serve_app.messages.StreamUsage`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Any, AsyncIterator

import numpy as np
from ray import serve

from serve_app import errors
from serve_app.config import DEFAULT_VOICE_STORE, BatchingConfig
from serve_app.engines.base import (
    AudioChunk,
    EngineOverloadedError,
    InvalidRequestError,
    SpeechRequest,
    refuse_unsupported,
)
from serve_app.errors import ApiError
from serve_app.gpu.admission import BatchedAdmission, refused
from serve_app.gpu.engine_client import (
    ENGINE_TTFB_TIMINGS,
    WAY_BACK_CLOCKS,
    EngineClient,
    EngineDeadError,
)
from serve_app.gpu.engine_watch import EngineWatch, exit_soon, rss_bytes
from serve_app.gpu.replica_voices import ReplicaVoices
from serve_app.gpu.routing import routing_stats
from serve_app.gpu.text_inbox import InboxReader, start_inbox
from serve_app.hops import StreamTimeout, within
from serve_app.messages import EngineInfo, StreamUsage, TextInputOpen
from serve_app.observability.gc_pauses import log_pauses, settle_replica_process
from serve_app.observability.logs import use_replica_log
from serve_app.voices.clip import is_voice_id
from serve_app.voices.store import VoiceStore

logger = logging.getLogger(__name__)

StreamItem = AudioChunk | ApiError | StreamUsage | TextInputOpen
# A first chunk's clock reading (time.perf_counter) of the engine's answer to its submission.
ADMITTED_CLOCK = "clock_replica_admitted"


# Fractional CPU by default so the whole app fits two cores; the YAML overrides per profile.
# Bounded queue: beyond max_queued_requests the caller gets BackPressureError (503).
@serve.deployment(name="Synthesizer", max_ongoing_requests=64, max_queued_requests=64,
                  health_check_period_s=10, graceful_shutdown_timeout_s=90,
                  ray_actor_options={"num_cpus": 0.5})
class Synthesizer:
    """Loads and warms the engine in ``__init__``; Serve routes nothing here before that ends.

    If the engine process dies, open streams end with a 503 error and the replica exits a
    moment later, so Serve routes new requests to the others and replaces it at once (as when a
    GPU worker crashes); until then the health check fails too.

    Timeouts: a stream waits at most ``first_chunk_timeout_s`` for its first chunk (admission
    included) and ``chunk_timeout_s`` for each later one, else it is aborted and ends with a 504
    error. On shutdown it waits up to ``drain_timeout_s`` for active streams (Serve drains first).
    """

    def __init__(self, engine: str, engine_options: dict[str, Any],
                 first_chunk_timeout_s: float = 60.0, chunk_timeout_s: float = 30.0,
                 drain_timeout_s: float = 60.0,
                 voice_store: str = DEFAULT_VOICE_STORE) -> None:
        use_replica_log()
        self._first_chunk_timeout_s = first_chunk_timeout_s
        self._chunk_timeout_s = chunk_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self._in_flight = 0
        inbox = start_inbox()  # its process starts while the engine loads
        # Loaded and warmed up in its own process before this returns.
        self._engine = EngineClient.start(engine, engine_options, on_death=exit_soon)
        self._text = InboxReader(inbox, self._engine)
        self._voices = ReplicaVoices(self._engine, VoiceStore(voice_store))
        self._watch = EngineWatch(self._engine)
        self._admission = BatchedAdmission(self._engine, first_chunk_timeout_s)
        self._admission.apply(BatchingConfig())
        self._ready = True
        logger.info("engine %s loaded and warmed", engine)
        settle_replica_process()

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply new batching knobs (``user_config``) without restarting the replica."""
        self._admission.apply(BatchingConfig.model_validate(user_config))

    async def synthesize(self, request: SpeechRequest) -> AsyncIterator[StreamItem]:
        """Stream one request's chunks, then its StreamUsage (from the final chunk); a rejected
        or failed request ends with an ApiError instead. A streamed-input request first gets a
        TextInputOpen with this replica's text inbox, where its text goes
        (:mod:`serve_app.gpu.text_inbox`).

        The engine validates the request when its batch is submitted (once, touching nothing if
        it refuses); a refusal is this stream's only item.
        """
        try:
            refuse_unsupported(self._engine.info, request)
        except InvalidRequestError as exc:
            yield refused(request.request_id, exc)
            return
        request_id = request.request_id
        arrived_s = time.perf_counter()
        first_chunk: AudioChunk | None = None
        replica_ttfb_s = 0.0
        self._watch.waiting_for_admission.add(request_id)
        self._watch.watch()
        self._in_flight += 1
        finished = False
        items = within(self._admitted(request), self._first_chunk_timeout_s,
                       self._chunk_timeout_s)
        try:
            async for item in items:
                if isinstance(item, ApiError):
                    yield _answered(request_id, arrived_s, item)
                    break
                yield item
                if isinstance(item, AudioChunk):
                    if first_chunk is None:
                        first_chunk, replica_ttfb_s = item, time.perf_counter() - arrived_s
                    if item.final:
                        yield item.usage or StreamUsage(0, 0)
            finished = True
        except StreamTimeout as exc:
            finished = True
            self._engine.abort(request_id)
            timed_out = errors.timed_out(request_id, "the engine", exc.waited_s)
            yield _answered(request_id, arrived_s, timed_out)
        except EngineDeadError as exc:
            finished = True
            yield _answered(request_id, arrived_s, errors.synthesis_unavailable(request_id, exc))
        except EngineOverloadedError as exc:  # refused while queued, before any audio: a 503
            finished = True
            yield _answered(request_id, arrived_s, errors.overloaded(exc.reason))
        except Exception as exc:  # one failing stream never ends the others
            finished = True
            self._engine.abort(request_id)
            yield _answered(request_id, arrived_s, errors.synthesis_failed(request_id, exc))
        finally:
            if first_chunk is not None:
                _log_first_chunk(request_id, arrived_s, replica_ttfb_s, first_chunk)
            log_pauses()
            self._in_flight -= 1
            self._watch.waiting_for_admission.discard(request_id)
            # Caller gone (cancelled or closed) before the end: free the engine slot now. This
            # also covers a request cancelled between its admission and its first chunk.
            if not finished:
                self._engine.abort(request_id)

    async def _admitted(self, request: SpeechRequest) -> AsyncIterator[AudioChunk | ApiError]:
        """Load the request's stored voice if need be, wait for the request's batch to be
        submitted, then relay its engine stream. A stream the engine has no room for (its
        stats as last pushed, at most ~0.1 s old) is refused at once: before its voice is
        loaded, and without a submission, whose round trip to a busy engine would queue the
        rest of a burst behind the refusals (read at 3x on an H200: seconds)."""
        stats = self._engine.stats()
        if not stats.has_room(request.mode):
            yield errors.overloaded(stats.refusal_reason(request.mode))
            return
        admitted = await self._voices.admit(request, self._admission)
        admitted_at_s: float | None = time.perf_counter()  # the engine's answer came
        self._watch.waiting_for_admission.discard(request.request_id)
        if isinstance(admitted, ApiError):
            yield admitted
            return
        if request.text_input == "streamed":  # in the engine: the caller may feed text now
            self._text.start()
            yield TextInputOpen(serve.get_replica_context().replica_id.unique_id,
                                self._text.inbox)
        async for chunk in admitted:
            if admitted_at_s is not None:  # the first chunk (later ones are joined behind it)
                chunk.timings_s[ADMITTED_CLOCK], admitted_at_s = admitted_at_s, None
            yield chunk

    async def embed_voice(self, samples: np.ndarray, sample_rate_hz: int) -> np.ndarray | ApiError:
        """A new voice's embeddings from its reference clip (float32 mono), computed by the
        engine, for the ingress to store; an ApiError if the engine refuses the clip or cannot
        clone voices at all."""
        return await self._voices.embed(samples, sample_rate_hz)

    def ready(self) -> bool:
        return self._ready

    def record_routing_stats(self) -> dict[str, float]:
        """What the Synthesizer's request router reads (serve_app/gpu/routing.py): how many
        more read and chat streams this replica's engine has room for now."""
        return routing_stats(self._engine.stats(), time.monotonic())

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What the Synthesizer's autoscaling policy reads (serve_app/gpu/autoscaling.py): streams
        waiting, slot occupancy, step time over its real-time budget since the last report."""
        return self._watch.autoscaling_stats()

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine process or text inbox died is
        replaced."""
        if not self._engine.alive:
            raise RuntimeError("the engine process is gone")
        if not self._text.alive:
            raise RuntimeError("the text inbox is gone")

    async def info(self) -> EngineInfo:
        """The engine's facts and the voices it holds now. It also lists the stored voices it
        holds: those belong to API keys and are listed per key by GET /v1/audio/voices, never
        here."""
        voices = [voice for voice in await self._engine.voices() if not is_voice_id(voice)]
        return replace(self._engine.info, voices=voices)

    async def stats(self) -> dict[str, Any]:
        """Engine counters (current) plus the sizes of the ``@serve.batch`` batches so far."""
        return {"engine": (await self._engine.fresh_stats()).as_dict(),
                **self._admission.stats(), "voices": self._voices.stats()}

    def process_info(self) -> dict[str, Any]:
        """This replica's process id and resident memory (and its engine process's), for tests
        and the soak script."""
        return {"pid": os.getpid(), "rss_bytes": rss_bytes(os.getpid()),
                "engine_pid": self._engine.pid, "engine_rss_bytes": rss_bytes(self._engine.pid)}

    async def __del__(self) -> None:
        """Serve calls this after draining: wait for active streams, then close the engine."""
        engine = getattr(self, "_engine", None)
        if engine is None:
            return
        deadline = time.monotonic() + self._drain_timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self._in_flight:
            logger.warning("shutting down with %d streams still active", self._in_flight)
        self._text.stop()
        await asyncio.to_thread(engine.close)


def _answered(request_id: str, arrived_s: float, answer: ApiError) -> ApiError:
    """``answer``, logged: a stream that ends with an error (a refusal, most often), when it
    reached this replica (``arrived_clock``: ``time.perf_counter``, one clock for a machine's
    processes) and ms from there to the answer; scripts/bench_overload reads these lines."""
    logger.info("answered stream=%s status=%d code=%s arrived_clock=%.6f replica_ms=%.1f",
                request_id, answer.status_code, answer.code, arrived_s,
                (time.perf_counter() - arrived_s) * 1000)
    return answer


def _log_first_chunk(request_id: str, arrived_s: float, replica_ttfb_s: float,
                     chunk: AudioChunk) -> None:
    """Where a stream's first audio came from: ms from its arrival at this replica to its first
    chunk leaving, the engine's own TTFB (submission to first audio), and, on the way back, ms
    from the arrival to the engine process's sink taking the chunk, this replica's reader
    reading it and its event loop taking it, and to the engine's sender thread beginning to
    write it (``engine_client.stamp_way_back``), and the arrival's clock reading (as in
    :func:`_answered`); scripts/bench_serve reads these lines."""
    timings = chunk.timings_s
    engine_s = next((timings[name] for name in ENGINE_TTFB_TIMINGS if name in timings), None)

    sent, sending, received, dispatched, admitted = (
        f"{(timings[name] - arrived_s) * 1000:.1f}" if name in timings else "-"
        for name in (*WAY_BACK_CLOCKS, ADMITTED_CLOCK))
    logger.info("first audio of stream=%s replica_ttfb_ms=%.1f engine_ttfb_ms=%s "
                "engine_sent_ms=%s replica_received_ms=%s replica_dispatched_ms=%s "
                "engine_sending_ms=%s replica_admitted_ms=%s arrived_clock=%.6f", request_id,
                replica_ttfb_s * 1000, "-" if engine_s is None else f"{engine_s * 1000:.1f}",
                sent, received, dispatched, sending, admitted, arrived_s)