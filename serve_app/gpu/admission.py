"""The synthesizer's admission into its engine in ``@serve.batch`` batches.

The batch is admission only: requests that arrive together are submitted to the engine as one
batch (their prefills share a pass), and each request gets its own stream back at once. How many
streams run is then bounded by the engine's slots and ``max_ongoing_requests``; a long stream
never holds back the admission of the next request. The batching knobs come from the app config
and change live through ``user_config`` (:meth:`BatchedAdmission.apply`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, AsyncIterator

from ray import serve

from serve_app import errors
from serve_app.config import BatchingConfig
from serve_app.engines.base import (
    AudioChunk,
    EngineOverloadedError,
    InvalidRequestError,
    SpeechRequest,
)
from serve_app.errors import ApiError
from serve_app.gpu.engine_client import EngineClient

logger = logging.getLogger(__name__)

# A submission whose answer takes longer is logged (the engine process's loop shares its GIL
# with the step thread).
SLOW_SUBMISSION_S = 0.05
# A request's engine stream, or the ApiError that refused it.
Admitted = AsyncIterator[AudioChunk] | ApiError


def refused(request_id: str, exc: BaseException) -> ApiError:
    """The ApiError for an engine's refusal of (or failure to take) a request."""
    if isinstance(exc, EngineOverloadedError):
        return errors.overloaded(exc.reason)
    if isinstance(exc, InvalidRequestError):
        return errors.refused(exc)
    return errors.synthesis_unavailable(request_id, exc)  # the engine process is gone


class BatchedAdmission:
    """Submits requests to the engine in ``@serve.batch`` batches; call it with a request."""

    def __init__(self, engine: EngineClient, first_chunk_timeout_s: float) -> None:
        self._engine = engine
        self._first_chunk_timeout_s = first_chunk_timeout_s
        self.config: BatchingConfig | None = None
        self._batched: Any = None
        self.batch_sizes: Counter[int] = Counter()

    async def __call__(self, request: SpeechRequest) -> Admitted:
        """Wait for the request's batch to be submitted: its stream, or its refusal."""
        return await self._batched(request)

    def apply(self, config: BatchingConfig) -> None:
        """Use new batching knobs; submissions already under way finish under the old ones."""
        self._check(config)
        previous = self.config
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
        self.config = config
        logger.info("batching: %s", config.model_dump())

    def _check(self, config: BatchingConfig) -> None:
        """Refuse knobs that cannot work; warn about knobs that waste capacity."""
        if config.batch_wait_timeout_s >= self._first_chunk_timeout_s:
            raise ValueError(f"batch_wait_timeout_s ({config.batch_wait_timeout_s:g} s) must be "
                             f"shorter than first_chunk_timeout_s "
                             f"({self._first_chunk_timeout_s:g} s): every request would time out")
        slots = self._engine.info.max_slots
        if config.max_batch_size > slots:
            logger.warning("max_batch_size %d > the engine's %d slots: the rest of a batch waits "
                           "in the engine's queue", config.max_batch_size, slots)

    async def _admit_batch(self, requests: list[SpeechRequest]) -> list[Admitted]:
        """Batched body: submit the batch and hand each request its stream; returns at once."""
        self.batch_sizes[len(requests)] += 1
        started_s = time.perf_counter()
        try:
            # One bad request never sinks its batch: the engine process refuses it alone.
            outcomes = await self._engine.submit(requests)
        except Exception as exc:  # the engine process is gone (or failed the whole call)
            return [refused(request.request_id, exc) for request in requests]
        round_trip_s = time.perf_counter() - started_s
        if round_trip_s > SLOW_SUBMISSION_S:  # the engine process answers late: say so
            logger.info("slow submission: batch=%d round_trip_ms=%.1f", len(requests),
                        round_trip_s * 1000)
        return [refused(request.request_id, outcome) if isinstance(outcome, Exception)
                else outcome for request, outcome in zip(requests, outcomes)]

    def stats(self) -> dict[str, Any]:
        """The sizes of the batches so far and the knobs in force."""
        assert self.config is not None
        return {"batch_sizes": dict(self.batch_sizes),
                "max_batch_size_formed": max(self.batch_sizes, default=0),
                "batching": self.config.model_dump()}
