"""The benchmark-only engine setting (``engine_options.benchmark``): off unless asked for.

Benchmarks of the served app need the real code path on a GPU without the trained weights:
full-size random weights (``random_weights``), and fixed lengths, since random weights never
stop by themselves (every read stream speaks ``audio_seconds``; every chat answer has
``chat_tokens`` LLM tokens). Requests then ignore end-of-audio. Everything else (config,
deployments, HTTP) is the production path. The engine logs the setting loudly and ``/v1/models``
shows it, so no one mistakes such a server for a real one.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..base import LengthControls, SpeechRequest

logger = logging.getLogger(__name__)

FRAMES_PER_SECOND = 24_000 / 512


@dataclass(frozen=True)
class BenchmarkMode:
    """``random_weights`` needs ``tts_tokenizer``: a ChatTTS tokenizer folder (the tests' copy
    under ``tests/golden/chattts_tokenizer`` serves), since its special ids shape the TTS input."""

    random_weights: bool = False
    tts_tokenizer: str | None = None
    audio_seconds: float = 10.0
    chat_tokens: int = 40

    def __post_init__(self) -> None:
        if self.random_weights and not self.tts_tokenizer:
            raise ValueError("benchmark.random_weights needs benchmark.tts_tokenizer (a folder)")
        if self.audio_seconds <= 0 or self.chat_tokens < 1:
            raise ValueError("benchmark.audio_seconds must be > 0 and chat_tokens >= 1")

    @classmethod
    def from_options(cls, raw: dict[str, Any] | None) -> "BenchmarkMode | None":
        if raw is None:
            return None
        mode = cls(**raw)
        logger.warning("!!! BENCHMARK MODE: %s. Not for real traffic: %s", mode.describe(),
                       "the weights are random, the audio is noise" if mode.random_weights
                       else "every stream has a fixed length, end of audio is ignored")
        return mode

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def fix_lengths(self, request: SpeechRequest) -> SpeechRequest:
        """The request with this mode's fixed audio and chat lengths."""
        frames = max(1, round(self.audio_seconds * FRAMES_PER_SECOND))
        lengths = LengthControls(ignore_eos=True, audio_frames=frames,
                                 llm_tokens=self.chat_tokens if request.mode == "chat" else None)
        return replace(request, lengths=lengths)

    def random_model(self, device: torch.device, dtype: torch.dtype, clip_encoder: bool = True,
                     quantization: str = "none"):
        """Full-size random weights, built straight on ``device`` (with ``clip_encoder``, the
        Whisper-medium audio encoder and projection voice cloning needs too), the LLM's decoder
        layers quantized as they are built (``quantization``, an effective mode)."""
        from .model.synthetic import random_speech_model

        return random_speech_model(Path(self.tts_tokenizer), device, dtype,
                                   clip_encoder=clip_encoder, quantization=quantization)
