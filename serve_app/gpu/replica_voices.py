"""Cloned voices on a synthesizer replica.

:meth:`ReplicaVoices.embed` turns a new voice's clip into embeddings (once, at registration; the
ingress stores them). A request for a stored voice first makes sure this replica's engine has it
(:meth:`ReplicaVoices.ensure_loaded`, reading the embeddings from the
:class:`~serve_app.voices.store.VoiceStore`); the engine may evict it later, and a refusal with
``voice_not_found`` loads it again (:meth:`ReplicaVoices.admit`). Those two are the only engine
calls for voices.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import numpy as np

from serve_app import errors
from serve_app.engines.base import EngineOverloadedError, InvalidRequestError, SpeechRequest
from serve_app.errors import ApiError
from serve_app.gpu.admission import Admitted, refused
from serve_app.gpu.engine_client import EngineClient, EngineDeadError
from serve_app.voices.clip import is_voice_id
from serve_app.voices.store import VoiceNotFound, VoiceStore

logger = logging.getLogger(__name__)


def voice_evicted(admitted: Admitted) -> bool:
    """The engine refused the request's voice as not loaded (it evicted it)."""
    return (isinstance(admitted, ApiError) and admitted.param == "voice"
            and admitted.code == errors.VOICE_NOT_FOUND)


class ReplicaVoices:
    """The stored voices this replica added to its engine (the engine may have evicted some
    since: a voice_not_found refusal says so), one lock per voice being loaded, and how many
    loads and clip embeddings this replica did."""

    def __init__(self, engine: EngineClient, store: VoiceStore) -> None:
        self._engine = engine
        self._store = store
        self._loaded: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._loads = 0
        self._embeds = 0

    async def admit(self, request: SpeechRequest,
                    admission: Callable[[SpeechRequest], Awaitable[Admitted]]) -> Admitted:
        """``admission(request)``, with the request's stored voice loaded first if need be."""
        stored_voice = self._engine.info.clones_voices and is_voice_id(request.voice)
        missing = await self.ensure_loaded(request.voice) if stored_voice else None
        admitted: Admitted = missing or await admission(request)
        if stored_voice and not missing and voice_evicted(admitted):
            # Evicted between its load and this submission (other voices came in): once more.
            self._loaded.discard(request.voice)
            admitted = await self.ensure_loaded(request.voice) or await admission(request)
        return admitted

    async def ensure_loaded(self, voice_id: str) -> ApiError | None:
        """Make sure the engine holds the stored voice ``voice_id``: add it with the embeddings
        from the store unless this replica already did. None when it is there; a 404 ApiError
        when the store has no such voice (deleted meanwhile)."""
        if voice_id in self._loaded:
            return None
        lock = self._locks.setdefault(voice_id, asyncio.Lock())
        try:
            async with lock:  # concurrent first requests for one voice load it once
                if voice_id in self._loaded:
                    return None
                return await self._load(voice_id)
        finally:
            if not lock.locked() and self._locks.get(voice_id) is lock:
                del self._locks[voice_id]

    async def _load(self, voice_id: str) -> ApiError | None:
        try:
            embeddings = await asyncio.to_thread(self._store.embeddings, voice_id)
        except VoiceNotFound:
            return errors.voice_not_found(voice_id)
        except OSError as exc:  # a shared filesystem gone away: retry later
            logger.error("voice %s: the store is unavailable (%s)", voice_id, type(exc).__name__)
            return errors.voice_store_unavailable()
        try:
            await self._engine.call("add_voice", voice_id, embeddings)
        except (InvalidRequestError, EngineOverloadedError, EngineDeadError) as exc:
            # Every loaded voice busy (503), embeddings of another model (4xx), or the engine
            # process gone (503).
            logger.error("voice %s: the engine refused it (%s)", voice_id,
                         getattr(exc, "code", type(exc).__name__))
            return refused(voice_id, exc)
        # What the engine holds now (it may have dropped others to make room): the cache stays
        # within the engine's own bound.
        self._loaded = {voice_id} | (self._loaded & set(await self._engine.voices()))
        self._loads += 1
        logger.info("voice %s loaded into the engine (%s)", voice_id,
                    "x".join(map(str, embeddings.shape)))
        return None

    async def embed(self, samples: np.ndarray, sample_rate_hz: int) -> np.ndarray | ApiError:
        """A new voice's embeddings from its reference clip (float32 mono), computed by the
        engine; an ApiError if the engine refuses the clip or cannot clone voices at all."""
        if not self._engine.info.clones_voices:
            return errors.voice_cloning_unsupported(self._engine.info.model_id)
        try:
            embeddings = await self._engine.call("embed_voice", samples, sample_rate_hz)
        except (InvalidRequestError, EngineDeadError) as exc:
            return refused("voice clip", exc)
        except Exception as exc:  # one failing clip never takes the replica down
            logger.exception("embedding a voice clip failed")
            return errors.voice_embedding_failed(exc)
        self._embeds += 1
        return np.ascontiguousarray(embeddings, dtype=np.float32)

    def stats(self) -> dict[str, Any]:
        return {"loaded": len(self._loaded), "loads": self._loads, "embeds": self._embeds}
