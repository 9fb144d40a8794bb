"""examples/livekit_tts.py against the real app: a LiveKit Agents TTS that streams through
``WS /v1/audio/speech/stream``, driven through the ``livekit.agents.tts`` API an agent uses
(``stream()``: push text, end the input, iterate the audio; ``synthesize()``)."""

from __future__ import annotations

import asyncio
import time

import pytest
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

from examples.livekit_tts import SpeechStreamTTS
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

TEXT = ("A streamed answer arrives a few words at a time, and each word of its audio "
        "comes back with where it starts and ends.")
# Long enough that the engine is still synthesizing when the stream is closed (80 clauses).
LONG_TEXT = " ".join(f"Sentence {n} of a long answer is spoken, clause by clause."
                     for n in range(1, 41))


def speech_tts(server: Server, sample_rate: int = 24000) -> SpeechStreamTTS:
    return SpeechStreamTTS(url=server.base_url.replace("http://", "ws://")
                           + "/v1/audio/speech/stream", api_key=server.api_key,
                           sample_rate=sample_rate)


async def engine_stats(server: Server) -> dict[str, int]:
    # Serve's handle answers synchronously only outside an event loop.
    return (await asyncio.to_thread(server.synthesizer_stats))["engine"]


async def test_streamed_text_gives_audio_at_the_rate_with_its_words_in_order_inside_it(
        server: Server) -> None:
    speech = speech_tts(server, sample_rate=16000)
    assert speech.capabilities.streaming and speech.capabilities.aligned_transcript
    frames, timed = [], []
    async with speech.stream() as stream:
        for index, word in enumerate(TEXT.split()):  # as an LLM's tokens
            stream.push_text(word if index == 0 else " " + word)
        stream.end_input()
        async for audio in stream:
            frame_start_s = sum(frame.duration for frame in frames)
            for word in audio.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []):
                timed.append((word, frame_start_s))
            frames.append(audio.frame)
    assert frames and all(f.sample_rate == 16000 and f.num_channels == 1 for f in frames)
    audio_s = sum(frame.duration for frame in frames)
    assert audio_s > 3.0  # the whole text was spoken
    # The aligned transcript: the text's words in order, each with the space after it.
    assert "".join(word for word, _ in timed) == TEXT + " "
    for (word, carried_from_s), (following, _) in zip(timed, timed[1:] + [(None, None)]):
        # Inside the audio, and not before the frame that carries it.
        assert carried_from_s <= word.start_time < word.end_time <= audio_s, word
        if following is not None:
            assert word.end_time <= following.start_time, (word, following)


async def test_synthesize_speaks_a_whole_text_with_its_words(server: Server) -> None:
    speech = speech_tts(server)
    words = []
    async with speech.synthesize(TEXT) as chunked:
        frames = []
        async for audio in chunked:
            frames.append(audio.frame)
            words += audio.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])
    assert all(frame.sample_rate == 24000 for frame in frames)
    assert sum(frame.duration for frame in frames) > 3.0
    assert "".join(words) == TEXT + " "


async def test_closing_the_stream_midway_stops_the_synthesis(server: Server) -> None:
    before = await engine_stats(server)
    stream = speech_tts(server).stream()
    stream.push_text(LONG_TEXT)  # no end_input: the agent is still writing
    first = await anext(stream)
    assert first.frame.duration > 0
    await stream.aclose()
    deadline = time.monotonic() + 60
    stats = await engine_stats(server)
    while stats["active_streams"] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        stats = await engine_stats(server)
    assert stats["active_streams"] == 0
    assert stats["aborted"] == before["aborted"] + 1, "the engine aborted the stream"
    # At once: the text is 80 clauses, one engine step each; a stream left open instead runs
    # on (26 steps here) until the service's idle limit ends it.
    assert stats["steps"] - before["steps"] < 10, (before, stats)
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
