"""Cloned voices: the voice turn's token layout, and the bounded table of registered voices.

A cloned voice is a first user turn that holds the reference clip's audio embeddings
(docs/minicpmo.md, "Cloned voices"). With causal attention that turn's LLM keys and values do
not depend on what follows, so they are computed once when the voice is added
(:class:`VoicePrefix`) and every request in the voice prefills only its own turn after them.

:class:`VoiceTable` keeps at most ``max_voices`` of them: the least recently used voice that no
queued or running stream holds is dropped to make room. Callers' threads (add, remove,
validate, submit) and the step thread (release) meet under its lock.
"""

from __future__ import annotations

import collections
import re
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..base import EngineOverloadedError, InvalidRequestError
from .text import VOICE_INSTRUCTION

DEFAULT_VOICE = "default"
AUDIO_START, AUDIO_END, AUDIO_PLACEHOLDER = "<|audio_start|>", "<|audio_end|>", "<unk>"
_VOICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def audio_tokens_per_chunk(chunk_length_s: float, pool_step: int) -> int:
    """Audio embeddings per ``chunk_length_s`` chunk: 100 mel frames a second, halved by the
    encoder's strided convolution, then pooled by ``pool_step`` (25 for 1 s and 2)."""
    mel_frames = int(chunk_length_s * 100)
    encoder_frames = (mel_frames - 1) // 2 + 1
    return (encoder_frames - pool_step) // pool_step + 1


def placeholder_chunks(audio_tokens: int, per_chunk: int) -> list[int]:
    """Placeholders per ``<|audio_start|>...<|audio_end|>`` chunk: ``per_chunk`` each, the rest
    in the last."""
    return [min(per_chunk, audio_tokens - start) for start in range(0, audio_tokens, per_chunk)]


@dataclass(frozen=True)
class VoiceTurn:
    """The voice turn's token ids and where in them the audio embeddings go (in order)."""

    token_ids: list[int]
    audio_positions: list[int]


def voice_turn(tokenize: Callable[[str], list[int]], token_id: Callable[[str], int],
               audio_tokens: int, per_chunk: int) -> VoiceTurn:
    """``<|im_start|>user\\nClone the voice in the provided audio prompt.\\n`` + the audio
    placeholders + ``<|im_end|>\\n``, as upstream's ``chat`` renders its voice-cloning system
    turn. The placeholders are laid out by construction, not found by searching the ids (a
    tokenizer may map ordinary words to ``<unk>`` too)."""
    start, end, placeholder = (token_id(t) for t in (AUDIO_START, AUDIO_END, AUDIO_PLACEHOLDER))
    ids = list(tokenize(f"<|im_start|>user\n{VOICE_INSTRUCTION}\n"))
    positions: list[int] = []
    for count in placeholder_chunks(audio_tokens, per_chunk):
        ids.append(start)
        positions.extend(range(len(ids), len(ids) + count))
        ids.extend([placeholder] * count)
        ids.append(end)
    ids.extend(tokenize("<|im_end|>\n"))
    return VoiceTurn(ids, positions)


@dataclass(eq=False)
class VoicePrefix:
    """A registered voice: its turn's token ids and that turn's LLM keys and values, each
    [layers, kv_heads, length, head_dim] on the engine's device."""

    voice_id: str
    token_ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    streams: int = 0  # queued or running streams in this voice (under the table's lock)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


def prefix_length(voice: VoicePrefix | None) -> int:
    """Positions a voice's turn takes before a request's own prompt (0 for the default)."""
    return voice.length if voice is not None else 0


def check_voice_id(voice_id: object) -> str:
    """``voice_id`` if it can name a cloned voice; else :class:`InvalidRequestError`."""
    if voice_id == DEFAULT_VOICE:
        raise InvalidRequestError(f"voice id {DEFAULT_VOICE!r} is the built-in voice's",
                                  "voice_id", code="reserved_voice_id")
    if not isinstance(voice_id, str) or not _VOICE_ID.fullmatch(voice_id):
        raise InvalidRequestError("a voice id is 1 to 128 characters: letters, digits and . _ : - "
                                  "(starting with a letter or digit)", "voice_id",
                                  code="invalid_voice_id")
    return voice_id


def voice_not_found(voice_id: str) -> InvalidRequestError:
    return InvalidRequestError(f"voice {voice_id!r} is not loaded in this engine (add it first)",
                               "voice", code="voice_not_found")


class VoiceTable:
    """Registered voices by id, least recently used first, at most ``max_voices``."""

    def __init__(self, max_voices: int) -> None:
        self.max_voices = max_voices
        self._lock = threading.Lock()
        self._voices: collections.OrderedDict[str, VoicePrefix] = collections.OrderedDict()

    def names(self) -> list[str]:
        with self._lock:
            return list(self._voices)

    def prefix_length(self, voice_id: str) -> int:
        """Tokens of the voice's turn; raises ``voice_not_found`` if it is not loaded."""
        with self._lock:
            voice = self._voices.get(voice_id)
            if voice is None:
                raise voice_not_found(voice_id)
            return voice.length

    def check_room(self, voice_id: str) -> None:
        """Raise :class:`EngineOverloadedError` if adding ``voice_id`` now would find no room
        (checked before the work of computing a voice; :meth:`add` checks again)."""
        with self._lock:
            self._evictable(voice_id)

    def add(self, voice: VoicePrefix) -> list[str]:
        """Register ``voice`` (replacing one of its id); returns the ids dropped for room."""
        with self._lock:
            dropped = self._evictable(voice.voice_id)
            for voice_id in dropped:
                del self._voices[voice_id]
            self._voices.pop(voice.voice_id, None)
            self._voices[voice.voice_id] = voice
            return dropped

    def remove(self, voice_id: str) -> bool:
        """Forget ``voice_id``; streams holding it keep their :class:`VoicePrefix`."""
        with self._lock:
            return self._voices.pop(voice_id, None) is not None

    def acquire(self, voice_ids: Sequence[str]) -> list[VoicePrefix | None]:
        """The voices of new streams (None for the default voice), held until :meth:`release`;
        all or none: raises ``voice_not_found`` if one is not loaded."""
        with self._lock:
            missing = [v for v in voice_ids if v != DEFAULT_VOICE and v not in self._voices]
            if missing:
                raise voice_not_found(missing[0])
            held: list[VoicePrefix | None] = []
            for voice_id in voice_ids:
                voice = self._voices.get(voice_id) if voice_id != DEFAULT_VOICE else None
                if voice is not None:
                    voice.streams += 1
                    self._voices.move_to_end(voice_id)
                held.append(voice)
            return held

    def release(self, voices: Sequence[VoicePrefix | None]) -> None:
        with self._lock:
            for voice in voices:
                if voice is not None:
                    voice.streams -= 1

    def _evictable(self, voice_id: str) -> list[str]:
        """The least recently used ids no stream holds that must go to make room for
        ``voice_id`` (under the lock)."""
        others = [v for v in self._voices.values() if v.voice_id != voice_id]
        excess = len(others) + 1 - self.max_voices
        if excess <= 0:
            return []
        idle = [v.voice_id for v in others if v.streams == 0]
        if len(idle) < excess:
            raise EngineOverloadedError(
                f"all {self.max_voices} loaded voices are in use by streams; add the voice again "
                "when one of them has finished", "voices")
        return idle[:excess]
