"""A stream's token usage (OpenAI's ``usage``): each engine counts it in its own units and puts
it on the stream's final chunk (:attr:`~serve_app.engines.base.AudioChunk.usage`)."""

from __future__ import annotations

from dataclasses import dataclass

# Engines without audio tokens of their own count one per 20 ms of audio.
DEFAULT_AUDIO_TOKENS_PER_S = 50


@dataclass(frozen=True)
class StreamUsage:
    """A finished stream's token counts: input, the spoken text plus the instructions; output,
    the engine's audio tokens."""

    input_tokens: int
    output_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens}


def usage_in_characters(text_chars: int, instructions: str | None, samples: int,
                        sample_rate_hz: int) -> StreamUsage:
    """For an engine without a tokenizer: a token per character of text and instructions, an
    audio token per 20 ms of audio (rounded up)."""
    per_token = int(sample_rate_hz / DEFAULT_AUDIO_TOKENS_PER_S)
    return StreamUsage(input_tokens=text_chars + len(instructions or ""),
                       output_tokens=-(-samples // per_token))
