"""OpenAI-style token usage of a finished stream, counted with the engine's own units."""

from __future__ import annotations

from serve_app.engines.base import Engine, SpeechRequest
from serve_app.messages import StreamUsage

# Engines without audio tokens of their own count one per 20 ms of audio.
DEFAULT_AUDIO_TOKENS_PER_S = 50


def count_text_tokens(engine: Engine, text: str) -> int:
    """Tokens of ``text`` in the engine's tokenizer; characters where the engine has none."""
    count = getattr(engine, "count_tokens", None)
    return count(text) if count is not None and text else len(text)


def stream_usage(engine: Engine, request: SpeechRequest, text: str, samples: int) -> StreamUsage:
    """Input: the spoken ``text`` plus the instructions; output: the engine's audio tokens."""
    input_tokens = count_text_tokens(engine, text)
    if request.system_prompt:
        input_tokens += count_text_tokens(engine, request.system_prompt)
    per_token = (getattr(engine, "samples_per_audio_token", None)
                 or engine.sample_rate_hz / DEFAULT_AUDIO_TOKENS_PER_S)
    return StreamUsage(input_tokens=input_tokens, output_tokens=-(-samples // int(per_token)))
