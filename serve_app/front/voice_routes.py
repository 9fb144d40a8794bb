"""``/v1/audio/voices``: create a voice from a reference clip, list, read and delete the caller's
voices. Routes of the Ingress's app (included before its class routes, like the speech socket's);
they read what the Ingress replica set up from the app's state: the voice store, the API keys
and config, the engine info and the Synthesizer handle that embeds a clip."""

# No `from __future__ import annotations`: FastAPI must see real types on the routes.
import asyncio
import functools
import logging
import time
from typing import Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from ray.serve.exceptions import BackPressureError

from serve_app import errors
from serve_app.config import ApiConfig
from serve_app.engines.base import InvalidRequestError
from serve_app.errors import ApiError
from serve_app.front.guard import KeyRing
from serve_app.voices.clip import check_name, decode_clip
from serve_app.voices.store import VoiceLimitReached, VoiceNotFound, VoiceStore, store_call

logger = logging.getLogger("serve_app.front.ingress")  # the ingress's log, as before the split

router = APIRouter()

# What the consent field of a voice upload may say to affirm it (case and spaces ignored).
CONSENT_AFFIRMED = ("true", "yes", "1", "on", "affirmed", "i consent")
CONSENT_DESCRIPTION = ("Required, and must be true: you attest that the person speaking in "
                       "audio_sample consented to having their voice cloned by this service")


def owner_of(http: Request) -> str:
    """The owner id of the caller's voices (a hash of its API key; one shared owner when the
    service runs without keys)."""
    keys: KeyRing = http.app.state.keys
    label = getattr(http.state, "api_key_label", None)
    if keys.enabled and label is None:  # RequestGuard authenticates every /v1 route
        raise ApiError(401, "missing or invalid API key", code="invalid_api_key")
    return keys.owner(label)


def _store(http: Request) -> VoiceStore:
    return http.app.state.voice_store


@router.post("/v1/audio/voices", summary="Create a voice from a reference clip",
             responses={409: {"description": "the key keeps max_voices_per_key voices"},
                        413: {"description": "upload larger than max_voice_upload_bytes"},
                        422: {"description": "the engine cannot clone voices (piper)"}})
async def create_voice(
        http: Request,
        name: str = Form(..., description="The voice's name (1 to 256 characters)"),
        audio_sample: UploadFile = File(
            ..., description="The reference clip: wav, flac, ogg or mp3, 1 to 30 s of one "
                             "person speaking"),
        consent: str | None = Form(None, description=CONSENT_DESCRIPTION),
) -> dict[str, Any]:
    """Multipart form: ``name``, ``audio_sample`` (file), ``consent`` (true). The clip is
    checked here, embedded once by a Synthesizer replica and stored with the voice."""
    api: ApiConfig = http.app.state.api_config
    voices = _store(http)
    info = await http.app.state.engine_info()
    if not info.clones_voices:
        raise errors.voice_cloning_unsupported(info.model_id)
    if (consent or "").strip().lower() not in CONSENT_AFFIRMED:
        raise ApiError(400, "consent must be true: attest that the person speaking in "
                            "audio_sample agreed to having their voice cloned",
                       param="consent", code="consent_required")
    try:
        name = check_name(name)
    except InvalidRequestError as exc:
        raise errors.refused(exc) from None
    owner = owner_of(http)
    limit = api.max_voices_per_key
    voice_limit = ApiError(409, f"this API key already keeps {limit} voices; delete one "
                                "first (DELETE /v1/audio/voices/{id})",
                           code="voice_limit_reached")
    if await store_call(voices.count, owner) >= limit:
        raise voice_limit
    data = await audio_sample.read()
    try:
        clip = await asyncio.to_thread(decode_clip, data, api.min_voice_clip_s,
                                       api.max_voice_clip_s)
    except InvalidRequestError as exc:
        raise errors.refused(exc) from None
    embeddings = await _embed(http, clip.samples, clip.sample_rate_hz)
    consent_record = {"attested": True, "statement": CONSENT_DESCRIPTION,
                      "at": int(time.time())}
    try:
        record = await store_call(
            functools.partial(voices.create, owner, name, clip, embeddings,
                              consent=consent_record, model_id=info.model_id,
                              max_voices=limit))
    except VoiceLimitReached:
        raise voice_limit from None
    logger.info("voice %s created (%.1f s clip, %s, embeddings %s)", record.id,
                record.clip_seconds, clip.container,
                "x".join(map(str, record.embedding_shape)))
    return record.public()


async def _embed(http: Request, samples: Any, sample_rate_hz: int) -> Any:
    """The clip's embeddings from a Synthesizer replica, or the ApiError it answered."""
    timeout_s = http.app.state.api_config.voice_embed_timeout_s
    call = http.app.state.synthesizer.embed_voice.remote(samples, sample_rate_hz)
    try:
        embedded = await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        call.cancel()
        logger.error("voice embedding: no answer within %.0f s", timeout_s)
        raise ApiError(504, "embedding the voice clip timed out", code="timeout",
                       error_type="server_error") from None
    except BackPressureError:
        raise errors.overloaded() from None
    except Exception as exc:  # a dead or restarting replica: Serve brings it back
        logger.error("voice embedding failed (%s)", type(exc).__name__)
        raise errors.not_ready() from None
    if isinstance(embedded, ApiError):
        raise embedded
    return embedded


@router.get("/v1/audio/voices", summary="The voices of the caller's API key")
async def list_voices(http: Request) -> dict[str, Any]:
    records = await store_call(_store(http).list, owner_of(http))
    return {"object": "list", "data": [record.public() for record in records]}


@router.get("/v1/audio/voices/{voice_id}", summary="One of the caller's voices",
            responses={404: {"description": "no such voice for this API key"}})
async def get_voice(voice_id: str, http: Request) -> dict[str, Any]:
    try:
        record = await store_call(_store(http).get, owner_of(http), voice_id)
    except VoiceNotFound:
        raise errors.voice_not_found(voice_id) from None
    return record.public()


@router.delete("/v1/audio/voices/{voice_id}", summary="Delete one of the caller's voices",
               responses={404: {"description": "no such voice for this API key"}})
async def delete_voice(voice_id: str, http: Request) -> dict[str, Any]:
    try:
        await store_call(_store(http).delete, owner_of(http), voice_id)
    except VoiceNotFound:
        raise errors.voice_not_found(voice_id) from None
    logger.info("voice %s deleted", voice_id)
    return {"id": voice_id, "object": "audio.voice.deleted", "deleted": True}
