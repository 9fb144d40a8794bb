"""A MiniCPM-o stream's token usage, counted where the engine tokenizes its text: the whole
text and the instructions when the request is planned (in the caller's thread), streamed text as
its :class:`~.text.TextFeed` tokenizes it; its output tokens are the audio code frames the TTS
generated for it. It goes out on the stream's final chunk (:mod:`.output`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..usage import StreamUsage
from .scheduler import Stream, StreamPlan


@dataclass
class CountedPlan(StreamPlan):
    """A plan with the input tokens known when it was made: the instructions', and the text's
    unless the text is streamed (its feed counts those)."""

    input_tokens: int = 0


def stream_usage(stream: Stream) -> StreamUsage:
    """The stream's usage at its end (a plan made without counts, as the golden tests' are,
    counts only its fed text)."""
    plan = stream.plan
    tokens = plan.input_tokens if isinstance(plan, CountedPlan) else 0
    if plan.text_feed is not None:
        tokens += plan.text_feed.tokens
    return StreamUsage(input_tokens=tokens, output_tokens=stream.tts_steps)
