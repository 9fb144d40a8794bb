"""Synthesizer deployment: owns the engine and admits requests into it in ``@serve.batch`` batches.

Each batch is submitted into the one shared engine, and up to ``max_concurrent_batches`` batches
stream at once, so a request arriving while others play joins the engine's running batch
(continuous batching happens inside the engine). The batching knobs come from the app config
and change live through ``user_config`` (:meth:`Synthesizer.reconfigure`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from typing import Any, AsyncIterator

from ray import serve

from serve_app.config import BatchingConfig
from serve_app.engines.base import (
    AudioChunk,
    EngineOverloadedError,
    InvalidRequestError,
    RequestAbortedError,
    SpeechRequest,
    refuse_unsupported,
)
from serve_app.engines.registry import create_engine
from serve_app.logs import use_replica_log
from serve_app.messages import EngineInfo, StreamError, StreamUsage, TextInputOpen
from serve_app.metrics import SynthesizerMetrics
from serve_app.routing import ROUTER_PATH
from serve_app.usage import stream_usage

logger = logging.getLogger(__name__)

# How often the engine gauges are refreshed while the engine is busy.
METRICS_REFRESH_S = 0.5

BatchItem = AudioChunk | StreamError
StreamItem = AudioChunk | StreamError | StreamUsage | TextInputOpen


def _invalid(exc: InvalidRequestError) -> StreamError:
    return StreamError(message=exc.message, status_code=exc.status_code, param=exc.param,
                       code=exc.code)


def _overloaded() -> StreamError:
    return StreamError(message="the service is at capacity; retry shortly", status_code=503,
                       code="overloaded", type="service_unavailable")


def _failed(request_id: str, exc: BaseException) -> StreamError:
    if isinstance(exc, EngineOverloadedError):
        return _overloaded()
    if not isinstance(exc, RequestAbortedError):
        logger.error("request %s: synthesis failed (%s)", request_id, type(exc).__name__)
    # The engine's own message may name internals; the caller gets a generic one.
    return StreamError(message="speech synthesis failed", status_code=500,
                       code="synthesis_failed", type="server_error")


def _timed_out(request_id: str, waited_s: float) -> StreamError:
    logger.error("request %s: engine sent nothing for %.1f s; aborted", request_id, waited_s)
    return StreamError(message="speech synthesis timed out", status_code=504, code="timeout",
                       type="server_error")


# Fractional CPU by default so the whole app fits two cores; the YAML overrides per profile.
# Bounded queue: beyond max_queued_requests the caller gets BackPressureError (503).
@serve.deployment(name="Synthesizer", max_ongoing_requests=64, max_queued_requests=64,
                  health_check_period_s=10, graceful_shutdown_timeout_s=90,
                  ray_actor_options={"num_cpus": 0.5},
                  request_router_config={"request_router_class": ROUTER_PATH})
class Synthesizer:
    """Loads and warms the engine in ``__init__``; Serve routes nothing here before that ends.

    Timeouts: a stream waits at most ``first_chunk_timeout_s`` for its first chunk and
    ``chunk_timeout_s`` for each later one, else it is aborted and ends with a 504 error.
    On shutdown it waits up to ``drain_timeout_s`` for active streams (Serve drains first).
    """

    def __init__(self, engine: str, engine_options: dict[str, Any],
                 first_chunk_timeout_s: float = 60.0, chunk_timeout_s: float = 30.0,
                 drain_timeout_s: float = 60.0) -> None:
        use_replica_log()
        self._engine_name = engine
        self._first_chunk_timeout_s = first_chunk_timeout_s
        self._chunk_timeout_s = chunk_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self._in_flight = 0
        self._engine = create_engine(engine, engine_options)
        self._engine.warmup()
        self._batch_sizes: Counter[int] = Counter()
        self._metrics = SynthesizerMetrics()
        self._waiting_for_admission: set[str] = set()
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
        previous = self._batching
        if previous is None or config.max_concurrent_batches != previous.max_concurrent_batches:
            # serve.batch has no setter for max_concurrent_batches: new requests go to a fresh
            # queue while batches already admitted finish on the old one.
            self._batched = serve.batch(
                max_batch_size=config.max_batch_size,
                batch_wait_timeout_s=config.batch_wait_timeout_s,
                max_concurrent_batches=config.max_concurrent_batches,
            )(self._generate_batch)
        else:
            self._batched.set_max_batch_size(config.max_batch_size)
            self._batched.set_batch_wait_timeout_s(config.batch_wait_timeout_s)
        self._batching = config
        logger.info("batching: %s", config.model_dump())

    async def synthesize(self, request: SpeechRequest) -> AsyncIterator[StreamItem]:
        """Stream one request's chunks, then its StreamUsage; a rejected or failed request ends
        with one StreamError instead."""
        try:
            refuse_unsupported(self._engine, request)
            self._engine.validate(request)
        except InvalidRequestError as exc:
            yield _invalid(exc)
            return
        self._waiting_for_admission.add(request.request_id)
        self._watch_metrics()
        finished = False
        self._in_flight += 1
        batches = self._batched(request)
        timeout_s = self._first_chunk_timeout_s
        samples = 0
        streamed = request.text_input == "streamed"
        if streamed:
            self._fed_text[request.request_id] = [request.text]
        try:
            while True:
                try:
                    items = await asyncio.wait_for(anext(batches), timeout_s)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    self._engine.abort(request.request_id)
                    finished = True
                    yield _timed_out(request.request_id, timeout_s)
                    return
                if streamed:  # admitted: the caller may feed text to this replica from now on
                    streamed = False
                    yield TextInputOpen(serve.get_replica_context().replica_id.unique_id)
                for item in items:
                    yield item
                    if isinstance(item, StreamError):
                        finished = True
                        return
                    samples += len(item.samples)
                if items:
                    timeout_s = self._chunk_timeout_s
            finished = True
            text = "".join(self._fed_text.get(request.request_id, [request.text]))
            yield stream_usage(self._engine, request, text, samples)
        finally:
            self._fed_text.pop(request.request_id, None)
            self._in_flight -= 1
            self._waiting_for_admission.discard(request.request_id)
            # Caller gone (cancelled or closed) before the end: free the engine slot now.
            if not finished:
                self._engine.abort(request.request_id)

    def feed_text(self, request_id: str, delta: str, done: bool = False, *,
                  pinned_replica: str) -> StreamError | None:
        """Append text to a streamed-input request of this replica's engine (routed here by
        :class:`~serve_app.routing.PinnedReplicaRouter`); a refusal comes back as StreamError."""
        if pinned_replica != serve.get_replica_context().replica_id.unique_id:
            logger.error("request %s: text for replica %s reached another", request_id,
                         pinned_replica)
            return StreamError(message="the stream's replica is gone", status_code=503,
                               code="stream_lost", type="service_unavailable")
        try:
            self._engine.feed_text(request_id, delta, done)
        except InvalidRequestError as exc:
            return _invalid(exc)
        fed = self._fed_text.get(request_id)
        if fed is not None:
            fed.append(delta)
        return None

    async def _generate_batch(self, requests: list[SpeechRequest]
                              ) -> AsyncIterator[list[Any]]:
        """Batched body: per iteration, per request, the items that arrived since the last one.

        An empty list means "nothing new yet"; ``StopIteration`` marks a finished request.
        """
        self._batch_sizes[len(requests)] += 1
        self._waiting_for_admission.difference_update(r.request_id for r in requests)
        iterators = self._submit(requests)
        # Admission: every caller hears at once that its request is in the engine.
        yield [[] for _ in requests]
        count = len(requests)
        pending: list[list[BatchItem]] = [[] for _ in range(count)]
        done = [False] * count
        reported = [False] * count
        arrived = asyncio.Event()

        async def pump(index: int, iterator: AsyncIterator[AudioChunk] | StreamError) -> None:
            try:
                if isinstance(iterator, StreamError):
                    pending[index].append(iterator)
                    return
                async for chunk in iterator:
                    pending[index].append(chunk)
                    arrived.set()
            except Exception as exc:  # one failing stream never ends the others
                pending[index].append(_failed(requests[index].request_id, exc))
            finally:
                done[index] = True
                arrived.set()

        tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
        try:
            while not all(reported):
                if not any(pending[i] or (done[i] and not reported[i]) for i in range(count)):
                    await arrived.wait()
                arrived.clear()
                results: list[Any] = []
                for i in range(count):
                    if reported[i]:
                        results.append(StopIteration)
                    elif pending[i]:
                        results.append(pending[i])
                        pending[i] = []
                    elif done[i]:
                        reported[i] = True
                        results.append(StopIteration)
                    else:
                        results.append([])
                yield results
        finally:
            for task in tasks:
                task.cancel()

    def _submit(self, requests: list[SpeechRequest]
                ) -> list[AsyncIterator[AudioChunk] | StreamError]:
        try:
            return list(self._engine.submit(requests))
        except (InvalidRequestError, EngineOverloadedError):
            # One bad request must not sink its batch: admit the others one by one.
            admitted: list[AsyncIterator[AudioChunk] | StreamError] = []
            for request in requests:
                try:
                    admitted.extend(self._engine.submit([request]))
                except InvalidRequestError as exc:
                    admitted.append(_invalid(exc))
                except EngineOverloadedError:
                    admitted.append(_overloaded())
            return admitted

    def _watch_metrics(self) -> None:
        if self._metrics_task is None or self._metrics_task.done():
            self._metrics_task = asyncio.get_running_loop().create_task(self._metrics_loop())

    async def _metrics_loop(self) -> None:
        """Refresh the engine gauges while the engine is busy, and once more when it idles."""
        while self._refresh_metrics():
            await asyncio.sleep(METRICS_REFRESH_S)

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

    def info(self) -> EngineInfo:
        return EngineInfo(engine=self._engine_name,
                          model_id=getattr(self._engine, "model_id", self._engine_name),
                          sample_rate_hz=self._engine.sample_rate_hz,
                          voices=list(self._engine.voices()), modes=list(self._engine.modes))

    def stats(self) -> dict[str, Any]:
        """Engine counters plus the sizes of the ``@serve.batch`` batches formed so far."""
        assert self._batching is not None
        return {
            "engine": self._engine.stats().as_dict(),
            "batch_sizes": dict(self._batch_sizes),
            "max_batch_size_formed": max(self._batch_sizes, default=0),
            "batching": self._batching.model_dump(),
        }

    def process_info(self) -> dict[str, Any]:
        """This replica's process id and resident memory, for tests and the soak script."""
        return {"pid": os.getpid(), "rss_bytes": _rss_bytes()}

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
        engine.close()


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
