"""Synthesizer deployment: owns the engine and admits requests into it in ``@serve.batch`` batches.

The engine runs in a process of its own (:mod:`serve_app.gpu.engine_process`), so nothing this
replica does for Ray and HTTP (relaying chunks, pickling them, metrics) competes with the
engine's step thread for the GIL; :class:`~serve_app.gpu.engine_client.EngineClient` is this side.

The batch is admission only: requests that arrive together are submitted to the engine as one
batch (their prefills share a pass), and each request gets its own stream back at once. How many
streams run is then bounded by the engine's slots and ``max_ongoing_requests``; a long stream
never holds back the admission of the next request. The batching knobs come from the app config
and change live through ``user_config`` (:meth:`Synthesizer.reconfigure`).

Cloned voices: :meth:`Synthesizer.embed_voice` turns a new voice's clip into embeddings (once,
at registration; the ingress stores them). A request for a stored voice first makes sure this
replica's engine has it (:meth:`Synthesizer._ensure_voice_loaded`, reading the embeddings from
the :class:`~serve_app.voices.store.VoiceStore`); the engine may evict it later, and a refusal with
``voice_not_found`` loads it again. Those two methods are the only engine calls for voices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from typing import Any, AsyncIterator

import numpy as np
from ray import serve

from serve_app import errors
from serve_app.gpu.autoscaling import engine_signals
from serve_app.config import DEFAULT_VOICE_STORE, BatchingConfig
from serve_app.gpu.engine_client import EngineClient, EngineDeadError
from serve_app.engines.base import (
    AudioChunk,
    EngineOverloadedError,
    EngineStats,
    InvalidRequestError,
    SpeechRequest,
    refuse_unsupported,
)
from serve_app.errors import ApiError
from serve_app.hops import StreamTimeout, within
from serve_app.observability.logs import use_replica_log
from serve_app.messages import EngineInfo, StreamUsage, TextInputOpen
from serve_app.observability.metrics import SynthesizerMetrics
from serve_app.gpu.routing import ROUTER_PATH
from serve_app.voices.clip import is_voice_id
from serve_app.voices.store import VoiceNotFound, VoiceStore

logger = logging.getLogger(__name__)

# How often the engine gauges are refreshed while the engine is busy.
METRICS_REFRESH_S = 0.5
# After its engine process died: time for the failed streams' errors to reach their callers
# before this replica exits (Serve then stops routing here and starts a new one).
EXIT_AFTER_ENGINE_DEATH_S = 1.0
ENGINE_DIED_EXIT_CODE = 70

Admitted = AsyncIterator[AudioChunk] | ApiError
StreamItem = AudioChunk | ApiError | StreamUsage | TextInputOpen


def _refused(request_id: str, exc: BaseException) -> ApiError:
    """The ApiError for an engine's refusal of (or failure to take) a request."""
    if isinstance(exc, EngineOverloadedError):
        return errors.overloaded()
    if isinstance(exc, InvalidRequestError):
        return errors.refused(exc)
    return errors.synthesis_unavailable(request_id, exc)  # the engine process is gone


def _voice_evicted(admitted: Admitted) -> bool:
    """The engine refused the request's voice as not loaded (it evicted it)."""
    return (isinstance(admitted, ApiError) and admitted.param == "voice"
            and admitted.code == errors.VOICE_NOT_FOUND)


# Fractional CPU by default so the whole app fits two cores; the YAML overrides per profile.
# Bounded queue: beyond max_queued_requests the caller gets BackPressureError (503).
@serve.deployment(name="Synthesizer", max_ongoing_requests=64, max_queued_requests=64,
                  health_check_period_s=10, graceful_shutdown_timeout_s=90,
                  ray_actor_options={"num_cpus": 0.5},
                  request_router_config={"request_router_class": ROUTER_PATH})
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
        self._engine_name = engine
        self._first_chunk_timeout_s = first_chunk_timeout_s
        self._chunk_timeout_s = chunk_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self._in_flight = 0
        # Loaded and warmed up in its own process before this returns.
        self._engine = EngineClient.start(engine, engine_options, on_death=_exit_soon)
        self._voice_store = VoiceStore(voice_store)
        # Stored voices this replica added to its engine (the engine may have evicted some
        # since: a voice_not_found refusal says so), one lock per voice being loaded, and how
        # many loads and clip embeddings this replica did (stats).
        self._loaded_voices: set[str] = set()
        self._voice_locks: dict[str, asyncio.Lock] = {}
        self._voice_loads = 0
        self._voice_embeds = 0
        self._batch_sizes: Counter[int] = Counter()
        self._metrics = SynthesizerMetrics()
        self._waiting_for_admission: set[str] = set()
        self._stats_at_last_report: EngineStats | None = None  # record_autoscaling_stats
        # Text fed so far to each streamed-input request on this replica (for its usage).
        self._fed_text: dict[str, list[str]] = {}
        self._metrics_task: asyncio.Task | None = None
        self._refresh_metrics()
        self._batching: BatchingConfig | None = None
        self._batched: Any = None
        self._apply_batching(BatchingConfig())
        self._ready = True
        logger.info("engine %s loaded and warmed", engine)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply new batching knobs (``user_config``) without restarting the replica."""
        self._apply_batching(BatchingConfig.model_validate(user_config))

    def _apply_batching(self, config: BatchingConfig) -> None:
        self._check_batching(config)
        previous = self._batching
        if previous is None or config.max_concurrent_batches != previous.max_concurrent_batches:
            # serve.batch has no setter for max_concurrent_batches: new requests go to a fresh
            # queue while submissions already under way finish on the old one.
            self._batched = serve.batch(
                max_batch_size=config.max_batch_size,
                batch_wait_timeout_s=config.batch_wait_timeout_s,
                max_concurrent_batches=config.max_concurrent_batches,
            )(self._admit_batch)
        else:
            self._batched.set_max_batch_size(config.max_batch_size)
            self._batched.set_batch_wait_timeout_s(config.batch_wait_timeout_s)
        self._batching = config
        logger.info("batching: %s", config.model_dump())

    def _check_batching(self, config: BatchingConfig) -> None:
        """Refuse knobs that cannot work; warn about knobs that waste capacity."""
        if config.batch_wait_timeout_s >= self._first_chunk_timeout_s:
            raise ValueError(f"batch_wait_timeout_s ({config.batch_wait_timeout_s:g} s) must be "
                             f"shorter than first_chunk_timeout_s "
                             f"({self._first_chunk_timeout_s:g} s): every request would time out")
        context = serve.get_replica_context()
        max_ongoing = context._deployment_config.max_ongoing_requests if context else None
        slots = self._engine.max_slots
        if max_ongoing is not None and config.max_batch_size > max_ongoing:
            logger.warning("max_batch_size %d > max_ongoing_requests %d: no batch can fill, each "
                           "waits batch_wait_timeout_s", config.max_batch_size, max_ongoing)
        if max_ongoing is not None and max_ongoing < slots:
            logger.warning("max_ongoing_requests %d < the engine's %d slots: %d slots stay idle",
                           max_ongoing, slots, slots - max_ongoing)
        if config.max_batch_size > slots:
            logger.warning("max_batch_size %d > the engine's %d slots: the rest of a batch waits "
                           "in the engine's queue", config.max_batch_size, slots)

    async def synthesize(self, request: SpeechRequest) -> AsyncIterator[StreamItem]:
        """Stream one request's chunks, then its StreamUsage; a rejected or failed request ends
        with an ApiError instead. A streamed-input request first gets a TextInputOpen naming this
        replica, where its text goes (:meth:`feed_text`).

        The engine validates the request when its batch is submitted (once, touching nothing if
        it refuses); a refusal is this stream's only item.
        """
        try:
            refuse_unsupported(self._engine, request)
        except InvalidRequestError as exc:
            yield _refused(request.request_id, exc)
            return
        request_id = request.request_id
        arrived_s = time.perf_counter()
        first_chunk: AudioChunk | None = None
        replica_ttfb_s = 0.0
        self._waiting_for_admission.add(request_id)
        self._watch_metrics()
        self._in_flight += 1
        finished = False
        items = within(self._admitted(request), self._first_chunk_timeout_s,
                       self._chunk_timeout_s)
        samples = 0
        if request.text_input == "streamed":
            self._fed_text[request_id] = [request.text]
        try:
            async for item in items:
                yield item
                if isinstance(item, ApiError):
                    break
                if isinstance(item, AudioChunk):
                    samples += len(item.samples)
                    if first_chunk is None:
                        first_chunk, replica_ttfb_s = item, time.perf_counter() - arrived_s
            else:
                text = "".join(self._fed_text.get(request_id, [request.text]))
                yield await self._engine.usage(request, text, samples)
            finished = True
        except StreamTimeout as exc:
            finished = True
            self._engine.abort(request_id)
            yield errors.timed_out(request_id, "the engine", exc.waited_s)
        except EngineDeadError as exc:
            finished = True
            yield errors.synthesis_unavailable(request_id, exc)
        except Exception as exc:  # one failing stream never ends the others
            finished = True
            self._engine.abort(request_id)
            yield errors.synthesis_failed(request_id, exc)
        finally:
            if first_chunk is not None:
                _log_first_chunk(request_id, replica_ttfb_s, first_chunk)
            self._fed_text.pop(request_id, None)
            self._in_flight -= 1
            self._waiting_for_admission.discard(request_id)
            # Caller gone (cancelled or closed) before the end: free the engine slot now. This
            # also covers a request cancelled between its admission and its first chunk.
            if not finished:
                self._engine.abort(request_id)

    async def _admitted(self, request: SpeechRequest) -> AsyncIterator[AudioChunk | ApiError]:
        """Load the request's stored voice if need be, wait for the request's batch to be
        submitted, then relay its engine stream."""
        stored_voice = self._clones_voices and is_voice_id(request.voice)
        missing = await self._ensure_voice_loaded(request.voice) if stored_voice else None
        admitted: Admitted = missing or await self._batched(request)
        if stored_voice and not missing and _voice_evicted(admitted):
            # Evicted between its load and this submission (other voices came in): once more.
            self._loaded_voices.discard(request.voice)
            admitted = (await self._ensure_voice_loaded(request.voice)
                        or await self._batched(request))
        self._waiting_for_admission.discard(request.request_id)
        if isinstance(admitted, ApiError):
            yield admitted
            return
        if request.text_input == "streamed":  # in the engine: the caller may feed text now
            yield TextInputOpen(serve.get_replica_context().replica_id.unique_id)
        async for chunk in admitted:
            yield chunk

    @property
    def _clones_voices(self) -> bool:
        return self._engine.clones_voices

    async def _ensure_voice_loaded(self, voice_id: str) -> ApiError | None:
        """Make sure the engine holds the stored voice ``voice_id``: add it with the embeddings
        from the store unless this replica already did. None when it is there; a 404 ApiError
        when the store has no such voice (deleted meanwhile)."""
        if voice_id in self._loaded_voices:
            return None
        lock = self._voice_locks.setdefault(voice_id, asyncio.Lock())
        try:
            async with lock:  # concurrent first requests for one voice load it once
                if voice_id in self._loaded_voices:
                    return None
                try:
                    embeddings = await asyncio.to_thread(self._voice_store.embeddings, voice_id)
                except VoiceNotFound:
                    return errors.voice_not_found(voice_id)
                except OSError as exc:  # a shared filesystem gone away: retry later
                    logger.error("voice %s: the store is unavailable (%s)", voice_id,
                                 type(exc).__name__)
                    return errors.voice_store_unavailable()
                try:
                    await self._engine.call("add_voice", voice_id, embeddings)
                except (InvalidRequestError, EngineOverloadedError, EngineDeadError) as exc:
                    # Every loaded voice busy (503), embeddings of another model (4xx), or the
                    # engine process gone (503).
                    logger.error("voice %s: the engine refused it (%s)", voice_id,
                                 getattr(exc, "code", type(exc).__name__))
                    return _refused(voice_id, exc)
                # What the engine holds now (it may have dropped others to make room): the
                # cache stays within the engine's own bound.
                self._loaded_voices = {voice_id} | (self._loaded_voices
                                                    & set(await self._engine.voices()))
                self._voice_loads += 1
                logger.info("voice %s loaded into the engine (%s)", voice_id,
                            "x".join(map(str, embeddings.shape)))
                return None
        finally:
            if not lock.locked() and self._voice_locks.get(voice_id) is lock:
                del self._voice_locks[voice_id]

    async def embed_voice(self, samples: np.ndarray, sample_rate_hz: int) -> np.ndarray | ApiError:
        """A new voice's embeddings from its reference clip (float32 mono), computed by the
        engine, for the ingress to store; an ApiError if the engine refuses the clip or cannot
        clone voices at all."""
        if not self._clones_voices:
            return errors.voice_cloning_unsupported(self._model_id)
        try:
            embeddings = await self._engine.call("embed_voice", samples, sample_rate_hz)
        except (InvalidRequestError, EngineDeadError) as exc:
            return _refused("voice clip", exc)
        except Exception as exc:  # one failing clip never takes the replica down
            logger.exception("embedding a voice clip failed")
            return errors.voice_embedding_failed(exc)
        self._voice_embeds += 1
        return np.ascontiguousarray(embeddings, dtype=np.float32)

    @property
    def _model_id(self) -> str:
        return self._engine.model_id

    async def feed_text(self, request_id: str, delta: str, done: bool = False, *,
                        pinned_replica: str) -> ApiError | None:
        """Append text to a streamed-input request of this replica's engine (routed here by
        :class:`~serve_app.gpu.routing.PinnedReplicaRouter`); a refusal comes back as an ApiError."""
        if pinned_replica != serve.get_replica_context().replica_id.unique_id:
            logger.error("request %s: text for replica %s reached another", request_id,
                         pinned_replica)
            return ApiError(503, "the stream's replica is gone", code="stream_lost")
        try:
            await self._engine.feed_text(request_id, delta, done)
        except (InvalidRequestError, EngineDeadError) as exc:
            return _refused(request_id, exc)
        fed = self._fed_text.get(request_id)
        if fed is not None:
            fed.append(delta)
        return None

    async def _admit_batch(self, requests: list[SpeechRequest]) -> list[Admitted]:
        """Batched body: submit the batch and hand each request its stream; returns at once."""
        self._batch_sizes[len(requests)] += 1
        try:
            # One bad request never sinks its batch: the engine process refuses it alone.
            outcomes = await self._engine.submit(requests)
        except Exception as exc:  # the engine process is gone (or failed the whole call)
            return [_refused(request.request_id, exc) for request in requests]
        return [_refused(request.request_id, outcome) if isinstance(outcome, Exception)
                else outcome for request, outcome in zip(requests, outcomes)]

    def _watch_metrics(self) -> None:
        if self._metrics_task is None or self._metrics_task.done():
            self._metrics_task = asyncio.get_running_loop().create_task(self._metrics_loop())

    async def _metrics_loop(self) -> None:
        """Refresh the engine gauges while the engine is busy, and once more when it idles;
        then log the busy period's steps and time per step (scripts/bench_serve reads it)."""
        before = self._engine.stats()
        while self._refresh_metrics():
            await asyncio.sleep(METRICS_REFRESH_S)
        after = self._engine.stats()
        steps = after.steps - before.steps
        if steps > 0:
            busy_s = after.step_seconds - before.step_seconds
            logger.info("engine busy period: steps=%d busy_s=%.3f ms_per_step=%.2f "
                        "streams_ended=%d llm_steps=%d device_memory_peak_gb=%.2f", steps,
                        busy_s, busy_s * 1000 / steps,
                        (after.completed + after.aborted + after.failed)
                        - (before.completed + before.aborted + before.failed),
                        after.llm_steps - before.llm_steps, after.device_memory_peak_bytes / 1e9)

    def _refresh_metrics(self) -> bool:
        """Record the engine's state; True while requests wait or streams run."""
        try:
            stats = self._engine.stats()
            self._metrics.refresh(stats, len(self._waiting_for_admission))
        except Exception:  # metrics must never break serving
            logger.exception("metrics refresh failed")
            return False
        return bool(self._waiting_for_admission or stats.active_streams or stats.queued_streams)

    def ready(self) -> bool:
        return self._ready

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What the Synthesizer's autoscaling policy reads (serve_app/gpu/autoscaling.py): streams
        waiting, slot occupancy, step time over its real-time budget since the last report."""
        stats = self._engine.stats()
        signals = engine_signals(stats, self._stats_at_last_report,
                                 len(self._waiting_for_admission))
        self._stats_at_last_report = stats
        return signals

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine process died is replaced."""
        if not self._engine.alive:
            raise RuntimeError("the engine process is gone")

    async def info(self) -> EngineInfo:
        # The engine also lists the stored voices it holds: those belong to API keys and are
        # listed per key by GET /v1/audio/voices, never here.
        voices = [voice for voice in await self._engine.voices() if not is_voice_id(voice)]
        return EngineInfo(engine=self._engine_name, model_id=self._model_id,
                          sample_rate_hz=self._engine.sample_rate_hz,
                          voices=voices, modes=list(self._engine.modes),
                          benchmark=self._engine.benchmark, clones_voices=self._clones_voices)

    async def stats(self) -> dict[str, Any]:
        """Engine counters (current) plus the sizes of the ``@serve.batch`` batches so far."""
        assert self._batching is not None
        return {
            "engine": (await self._engine.fresh_stats()).as_dict(),
            "batch_sizes": dict(self._batch_sizes),
            "max_batch_size_formed": max(self._batch_sizes, default=0),
            "batching": self._batching.model_dump(),
            "voices": {"loaded": len(self._loaded_voices), "loads": self._voice_loads,
                       "embeds": self._voice_embeds},
        }

    def process_info(self) -> dict[str, Any]:
        """This replica's process id and resident memory (and its engine process's), for tests
        and the soak script."""
        return {"pid": os.getpid(), "rss_bytes": _rss_bytes(os.getpid()),
                "engine_pid": self._engine.pid, "engine_rss_bytes": _rss_bytes(self._engine.pid)}

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
        await asyncio.to_thread(engine.close)


def _exit_soon() -> None:
    """The engine process is gone: end this replica once the streams' errors are out."""
    logger.critical("the engine process exited; this replica exits in %.0f s",
                    EXIT_AFTER_ENGINE_DEATH_S)

    def leave() -> None:
        for handler in logging.getLogger("serve_app").handlers:
            handler.flush()
        os._exit(ENGINE_DIED_EXIT_CODE)

    timer = threading.Timer(EXIT_AFTER_ENGINE_DEATH_S, leave)
    timer.daemon = True
    timer.start()


def _log_first_chunk(request_id: str, replica_ttfb_s: float, chunk: AudioChunk) -> None:
    """Where a stream's first audio came from: seconds from its arrival at this replica, and
    the engine's own (submission to first audio); scripts/bench_serve reads these lines."""
    engine_s = chunk.timings_s.get("ttfb_s", chunk.timings_s.get("first_chunk_s"))
    logger.info("first audio of stream=%s replica_ttfb_ms=%.1f engine_ttfb_ms=%s", request_id,
                replica_ttfb_s * 1000, "-" if engine_s is None else f"{engine_s * 1000:.1f}")


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # the process is gone
        return 0
