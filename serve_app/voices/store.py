"""The store that keeps cloned voices, and how the front resolves a request's voice.

A voice is created once (``POST /v1/audio/voices``): the ingress checks the clip
(:func:`decode_clip`), a Synthesizer replica embeds it (``Synthesizer.embed_voice``), and the
ingress writes it to the :class:`VoiceStore`. Every Synthesizer replica later reads the
embeddings from the store when a request first asks for the voice; nothing is re-embedded.

The store is a folder (``api.voice_store``): local for one machine, a shared filesystem (NFS,
EFS) mounted at the same path on every node of a cluster. Layout::

    <root>/<owner>/<voice_id>/voice.json       metadata (no key: the owner is a hash of it)
    <root>/<owner>/<voice_id>/embeddings.npy   float32 [frames, hidden], the engine's
    <root>/<owner>/<voice_id>/clip.flac        the reference clip, to re-embed for a new model

A voice is written into a hidden folder of its owner's and renamed into place in one step, so a
reader sees a whole voice or none; deleting renames it away first, then removes the files. The
owner folder makes ownership structural: a lookup under another key's owner finds nothing.
"""


from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import soundfile as sf

from serve_app import errors
from serve_app.messages import EngineInfo
from serve_app.voices.clip import (
    DEFAULT_VOICE,
    VOICE_ID_PREFIX,
    Clip,
    is_owner_id,
    is_voice_id,
    new_voice_id,
)

Result = TypeVar("Result")

logger = logging.getLogger(__name__)

# Writers that died mid-write leave hidden folders; older ones are swept on the next create.
STALE_WRITE_S = 3600.0
META_FILE = "voice.json"
EMBEDDINGS_FILE = "embeddings.npy"
CLIP_FILE = "clip.flac"
_INCOMING = ".incoming"
_DELETED = ".deleted"


# ---- the store ---------------------------------------------------------------------------------

class VoiceNotFound(LookupError):
    """No voice with this id for this owner (or none at all)."""


class VoiceLimitReached(Exception):
    """The owner already keeps the most voices allowed."""


@dataclass(frozen=True)
class VoiceRecord:
    """A stored voice's metadata (``voice.json``)."""

    id: str
    name: str
    owner: str
    created_at: int
    clip_seconds: float
    clip_sample_rate_hz: int
    consent: dict[str, Any]
    # What made the embeddings: the engine's model, and their shape (frames, hidden).
    model_id: str
    embedding_shape: tuple[int, ...]

    def public(self) -> dict[str, Any]:
        """The voice as the API shows it (OpenAI's ``audio.voice`` object)."""
        return {"id": self.id, "object": "audio.voice", "name": self.name,
                "created_at": self.created_at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "VoiceRecord":
        return cls(**{**data, "embedding_shape": tuple(data["embedding_shape"])})


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on folders: best effort
        pass
    finally:
        os.close(fd)


class VoiceStore:
    """Voices on a filesystem shared by every replica (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()

    def _owner_dir(self, owner: str) -> Path:
        if not is_owner_id(owner):
            raise ValueError("not an owner id")
        return self.root / owner

    def _voice_dir(self, owner: str, voice_id: str) -> Path:
        if not is_voice_id(voice_id):  # never a path outside the store
            raise VoiceNotFound(voice_id)
        return self._owner_dir(owner) / voice_id

    # ---- reading ---------------------------------------------------------------------------

    def get(self, owner: str, voice_id: str) -> VoiceRecord:
        try:
            text = (self._voice_dir(owner, voice_id) / META_FILE).read_text("utf-8")
        except (FileNotFoundError, NotADirectoryError):
            raise VoiceNotFound(voice_id) from None
        return VoiceRecord.from_json(json.loads(text))

    def list(self, owner: str) -> list[VoiceRecord]:
        """The owner's voices, oldest first."""
        try:
            names = os.listdir(self._owner_dir(owner))
        except FileNotFoundError:
            return []
        records = []
        for name in names:
            if not is_voice_id(name):
                continue
            try:
                records.append(self.get(owner, name))
            except VoiceNotFound:  # deleted meanwhile
                continue
        return sorted(records, key=lambda record: (record.created_at, record.id))

    def count(self, owner: str) -> int:
        try:
            return sum(is_voice_id(name) for name in os.listdir(self._owner_dir(owner)))
        except FileNotFoundError:
            return 0

    def embeddings(self, voice_id: str) -> np.ndarray:
        """The voice's embeddings, whoever owns it (the Synthesizer's read: the ingress has
        already checked the caller's ownership)."""
        if not is_voice_id(voice_id):
            raise VoiceNotFound(voice_id)
        try:
            owners = os.listdir(self.root)
        except FileNotFoundError:
            raise VoiceNotFound(voice_id) from None
        for owner in owners:
            if not is_owner_id(owner):
                continue
            try:
                return np.load(self.root / owner / voice_id / EMBEDDINGS_FILE,
                               allow_pickle=False)
            except (FileNotFoundError, NotADirectoryError):
                continue
        raise VoiceNotFound(voice_id)

    def clip(self, owner: str, voice_id: str) -> tuple[np.ndarray, int]:
        """The reference clip (float32 mono, its rate): to re-embed the voice for a new model."""
        try:
            samples, rate = sf.read(self._voice_dir(owner, voice_id) / CLIP_FILE,
                                    dtype="float32")
        except (FileNotFoundError, sf.LibsndfileError):
            raise VoiceNotFound(voice_id) from None
        return samples, rate

    # ---- writing ---------------------------------------------------------------------------

    def create(self, owner: str, name: str, clip: Clip, embeddings: np.ndarray, *,
               consent: dict[str, Any], model_id: str, max_voices: int | None = None
               ) -> VoiceRecord:
        """Write a new voice and return its record; :class:`VoiceLimitReached` if the owner
        already keeps ``max_voices``. Atomic: readers see the whole voice or nothing."""
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        if max_voices is not None and self.count(owner) >= max_voices:
            raise VoiceLimitReached(owner)
        record = VoiceRecord(
            id=new_voice_id(), name=name, owner=owner, created_at=int(time.time()),
            clip_seconds=round(clip.seconds, 3), clip_sample_rate_hz=clip.sample_rate_hz,
            consent=consent, model_id=model_id, embedding_shape=tuple(embeddings.shape))
        owner_dir = self._owner_dir(owner)
        incoming = owner_dir / _INCOMING
        incoming.mkdir(parents=True, exist_ok=True)
        self._sweep(incoming)
        staging = incoming / f"{record.id}-{secrets.token_hex(4)}"
        staging.mkdir()
        try:
            with open(staging / EMBEDDINGS_FILE, "wb") as file:
                np.save(file, embeddings, allow_pickle=False)
                file.flush()
                os.fsync(file.fileno())
            with open(staging / CLIP_FILE, "wb") as file:
                sf.write(file, clip.samples, clip.sample_rate_hz, format="FLAC", subtype="PCM_24")
                file.flush()
                os.fsync(file.fileno())
            with open(staging / META_FILE, "w", encoding="utf-8") as file:
                json.dump(asdict(record), file, indent=1)
                file.flush()
                os.fsync(file.fileno())
            # Checked again just before the voice appears: concurrent creates by one key can
            # overshoot the limit only within this window.
            if max_voices is not None and self.count(owner) >= max_voices:
                raise VoiceLimitReached(owner)
            os.rename(staging, owner_dir / record.id)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _fsync(owner_dir)
        return record

    def delete(self, owner: str, voice_id: str) -> None:
        """Remove the voice (metadata, embeddings and clip); :class:`VoiceNotFound` if the owner
        has none with this id."""
        source = self._voice_dir(owner, voice_id)
        trash = self._owner_dir(owner) / _DELETED
        trash.mkdir(parents=True, exist_ok=True)
        target = trash / f"{voice_id}-{secrets.token_hex(4)}"
        try:
            os.rename(source, target)  # gone for every reader at once
        except FileNotFoundError:
            raise VoiceNotFound(voice_id) from None
        shutil.rmtree(target, ignore_errors=True)

    def _sweep(self, incoming: Path) -> None:
        """Remove what writers that died mid-write left behind, long ago."""
        cutoff = time.time() - STALE_WRITE_S
        try:
            entries = list(os.scandir(incoming))
        except FileNotFoundError:
            return
        for entry in entries:
            try:
                if entry.stat().st_mtime < cutoff:
                    shutil.rmtree(entry.path, ignore_errors=True)
            except FileNotFoundError:
                continue


# ---- the ingress's side --------------------------------------------------------------------------

async def store_call(function: Callable[..., Result], *args: Any) -> Result:
    """``function(*args)`` on the store, off the event loop; a store that cannot be read or
    written (a shared filesystem gone away, a full disk) is a 503, never a 500."""
    try:
        return await asyncio.to_thread(function, *args)
    except OSError as exc:
        logger.error("voice store unavailable (%s: %s)", type(exc).__name__, exc.strerror)
        raise errors.voice_store_unavailable() from None


async def resolve_voice(store: VoiceStore, owner: str, voice: str, aliases: list[str],
                        engine: EngineInfo) -> str:
    """The engine voice a speech request asks for: an OpenAI alias is the engine's default
    voice; a stored voice must exist for ``owner`` (else a 404 ApiError, whether it never
    existed or belongs to another key); any other name must be one of ``engine``'s voices or
    ``default`` (else a 400 ApiError listing them and the aliases), so a bad voice never reaches
    the GPU."""
    if voice in aliases:
        return DEFAULT_VOICE
    if voice.startswith(VOICE_ID_PREFIX):
        try:
            await store_call(store.get, owner, voice)
        except VoiceNotFound:
            raise errors.voice_not_found(voice) from None
        return voice
    names = list(dict.fromkeys([*engine.voices, DEFAULT_VOICE]))
    if voice not in names:
        raise errors.unknown_voice(voice, names, aliases, engine.clones_voices)
    return voice
