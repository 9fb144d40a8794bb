"""Who a voice belongs to, and the uploaded reference clip: checked before anything is
embedded or stored (:func:`decode_clip`, :func:`check_name`, :func:`owner_of_key`).

The store that keeps voices is :mod:`serve_app.voices.store`.
"""

from __future__ import annotations

import hashlib
import io
import re
import secrets
import unicodedata
from dataclasses import dataclass

import numpy as np
import soundfile as sf

from serve_app.engines.base import MAX_CLIP_RATE_HZ, MIN_CLIP_RATE_HZ, InvalidRequestError

VOICE_ID_PREFIX = "voice_"
# The name every engine takes for its own default voice (what the OpenAI voice names mean).
DEFAULT_VOICE = "default"
_VOICE_ID = re.compile(r"^voice_[0-9a-f]{24}$")
_OWNER = re.compile(r"^[0-9a-z]{1,64}$")
# The owner of every voice when the service runs without API keys: all callers share it.
SHARED_OWNER = "shared"
MAX_NAME_CHARS = 256
# Containers libsndfile reads that a voice clip may come in (soundfile's format names).
CLIP_CONTAINERS = {"WAV": "wav", "WAVEX": "wav", "FLAC": "flac", "OGG": "ogg", "MP3": "mp3"}
# Below this RMS (-60 dBFS) a clip holds no voice to clone.
SILENCE_RMS = 1e-3


AUDIO_PARAM = "audio_sample"


def is_voice_id(value: str) -> bool:
    """Whether ``value`` is a stored voice's id (``voice_`` and 24 hex digits)."""
    return bool(_VOICE_ID.match(value))


def is_owner_id(value: str) -> bool:
    """Whether ``value`` is an owner id as :func:`owner_of_key` makes them (or the shared one)."""
    return bool(_OWNER.match(value))


def new_voice_id() -> str:
    return VOICE_ID_PREFIX + secrets.token_hex(12)


def owner_of_key(key: str | None) -> str:
    """The owner id of the voices an API key creates: a hash of the key, never the key. Without
    keys every caller is :data:`SHARED_OWNER`."""
    if key is None:
        return SHARED_OWNER
    return hashlib.sha256(b"serve_app voice owner\x00" + key.encode()).hexdigest()[:32]


# ---- the uploaded clip -------------------------------------------------------------------------

@dataclass(frozen=True)
class Clip:
    """A reference clip, decoded: float32 mono samples in [-1, 1]."""

    samples: np.ndarray
    sample_rate_hz: int
    container: str

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate_hz


def _refuse(message: str, code: str) -> InvalidRequestError:
    return InvalidRequestError(message, AUDIO_PARAM, code=code)


def decode_clip(data: bytes, min_s: float, max_s: float) -> Clip:
    """The clip in ``data`` (wav, flac, ogg or mp3), or :class:`InvalidRequestError` naming
    ``audio_sample``: not audio, another container, a sample rate out of range, shorter than
    ``min_s`` or longer than ``max_s`` seconds, non-finite or silent."""
    if not data:
        raise _refuse("audio_sample is empty", "invalid_audio")
    try:
        info = sf.info(io.BytesIO(data))
    except Exception:  # libsndfile says only that it cannot read it
        raise _refuse("audio_sample is not audio this server can read: send wav, flac, ogg or "
                      "mp3", "invalid_audio") from None
    container = CLIP_CONTAINERS.get(info.format)
    if container is None:
        raise _refuse(f"audio_sample is {info.format_info or info.format}: send wav, flac, ogg "
                      "or mp3", "unsupported_audio_format")
    rate = int(info.samplerate)
    if not MIN_CLIP_RATE_HZ <= rate <= MAX_CLIP_RATE_HZ:
        raise _refuse(f"audio_sample is sampled at {rate} Hz; send {MIN_CLIP_RATE_HZ} to "
                      f"{MAX_CLIP_RATE_HZ} Hz", "unsupported_sample_rate")
    too_long = _refuse(f"audio_sample is longer than {max_s:g} s", "audio_too_long")
    max_frames = int(max_s * rate) + 1
    if 0 < info.frames and info.frames > max_frames and info.frames < 2**62:
        raise too_long  # said by the header: refused before decoding
    try:
        # Never more than the limit decoded: a tiny compressed file may unpack to hours.
        samples, rate = sf.read(io.BytesIO(data), frames=max_frames + 1, dtype="float32",
                                always_2d=True)
    except Exception:
        raise _refuse("audio_sample could not be decoded (a damaged or truncated file?)",
                      "invalid_audio") from None
    if len(samples) > max_frames:
        raise too_long
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    seconds = len(mono) / rate
    if seconds < min_s:
        raise _refuse(f"audio_sample is {seconds:.2f} s long; a voice needs at least {min_s:g} s "
                      "of speech", "audio_too_short")
    if not np.isfinite(mono).all():
        raise _refuse("audio_sample holds non-finite samples", "invalid_audio")
    if float(np.sqrt(np.mean(np.square(mono, dtype=np.float64)))) < SILENCE_RMS:
        raise _refuse("audio_sample is silent: record someone speaking", "silent_audio")
    return Clip(np.ascontiguousarray(np.clip(mono, -1.0, 1.0)), int(rate), container)


def check_name(name: str | None) -> str:
    """A voice's display name, trimmed: 1 to 256 characters, no control characters."""
    name = (name or "").strip()
    if not name:
        raise InvalidRequestError("name must not be empty", "name", code="invalid_value")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidRequestError(f"name is longer than {MAX_NAME_CHARS} characters", "name",
                                  code="string_too_long")
    if any(unicodedata.category(char) in ("Cc", "Cs") for char in name):
        raise InvalidRequestError("name must not contain control characters", "name",
                                  code="invalid_value")
    return name


