"""What the soak sends: its sentences, formats and bad requests, and how it checks a body."""

from __future__ import annotations

import json
import random
from typing import Any

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech should start playing within a fraction of a second.",
    "Every accepted request ends in a complete stream or an explicit error.",
    "Numbers like 42 and 3.14 are read aloud as words.",
    "A client that hangs up frees its slot at once.",
    "Short one.",
    "This sentence, with a comma or two, keeps going for a little while longer than most.",
]
NATIVE_FORMATS = [("wav", 24000), ("pcm", 16000), ("mp3", 22050), ("flac", 48000),
                  ("opus", 24000), ("wav", 8000)]
OPENAI_FORMATS = ["mp3", "wav", "pcm", "opus", "flac"]
MAGIC = {"wav": b"RIFF", "flac": b"fLaC", "opus": b"OggS"}


def valid_audio(data: bytes, audio_format: str) -> bool:
    if not data:
        return False
    if audio_format == "pcm":
        return len(data) % 2 == 0
    if audio_format == "mp3":
        return data[:3] == b"ID3" or data[0] == 0xFF
    return data[:4] == MAGIC[audio_format]


def speech_request(rng: random.Random) -> tuple[str, dict[str, Any], str]:
    text = " ".join(rng.sample(SENTENCES, rng.randint(1, 3)))
    if rng.random() < 0.5:
        audio_format = rng.choice(OPENAI_FORMATS)
        return "/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": text,
                                    "response_format": audio_format}, audio_format
    audio_format, rate = rng.choice(NATIVE_FORMATS)
    return "/v1/speech/stream", {"text": text, "format": audio_format, "sample_rate": rate,
                                 "speed": rng.choice([0.8, 1.0, 1.25])}, audio_format


BAD_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/audio/speech", {"content": b'{"model": "tts-1", "input": ',
                          "headers": {"content-type": "application/json"}}),
    ("/v1/audio/speech", {"json": {"model": "tts-1", "voice": "alloy", "input": "  "}}),
    ("/v1/audio/speech", {"json": {"model": "tts-9", "voice": "alloy", "input": "Hi."}}),
    ("/v1/speech/stream", {"json": {"text": "Hi.", "sample_rate": 12345}}),
    ("/v1/speech/stream", {"json": {"text": "a" * 5000}}),
    # A mode no engine has ("chat" would be bad on Piper only: MiniCPM-o speaks it).
    ("/v1/speech/stream", {"json": {"text": "Hi.", "mode": "sing"}}),
    ("/v1/speech/stream", {"content": b"text=hi", "headers": {"content-type": "text/plain"}}),
    ("/v1/speech/stream", {"json": {"text": "Hi."}, "headers": {"authorization": "Bearer no"}}),
    ("/v1/speech/stream", {"content": b"x" * 70_000,
                           "headers": {"content-type": "application/json"}}),
]
# Text with nothing to speak or a NUL (serve_app/engines/text_rule.py): a JSON 400 each, never a 5xx or
# an empty 200. Sent as escaped JSON, since a lone surrogate cannot be encoded as UTF-8.
HOSTILE_TEXTS = ["\u0000\u0001\u0002", "Hello\u0000world", "\u200b\u200b\u200b", " \t\u0007 ",
                 "...", "\U000c4a7e", "\ud800\u202e\ufeff"]
BAD_REQUESTS += [
    ("/v1/speech/stream", {"content": json.dumps({"text": text, "format": "wav"}).encode(),
                           "headers": {"content-type": "application/json"}})
    for text in HOSTILE_TEXTS]
