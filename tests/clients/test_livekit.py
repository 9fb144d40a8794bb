"""LiveKit Agents' OpenAI TTS (``livekit.plugins.openai.TTS``) as a client of the CPU service,
through ``POST /v1/audio/speech`` with ``base_url`` pointed at it.

Driven as LiveKit's own TTS tests drive a plugin: ``tts.synthesize(text)`` gives a
``ChunkedStream`` of ``SynthesizedAudio`` events, each with an ``rtc.AudioFrame``. The plugin
talks through the ``openai`` SDK (its own HTTP client), so it needs no aiohttp session
(``livekit.agents.utils.http_context``) and nothing downloaded: no tokenizer or model is used by
``synthesize``. With its default model, ``gpt-4o-mini-tts``, it asks for server-sent events
(``stream_format: sse``) and decodes the audio in them (mp3 by default) with PyAV; with
``tts-1`` it reads the audio bytes as they come.
"""

from __future__ import annotations

import asyncio

import pytest
from livekit.agents.tts import SynthesizedAudio
from livekit.plugins import openai as livekit_openai

from tests.clients.served import (
    LONG_TEXT,
    OPENAI_PCM_RATE_HZ,
    SENTENCE,
    assert_cut_short_by_the_client,
    assert_sounds_like_the_service,
    engine_stats,
)
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow


def livekit_tts(server: Server, voice: str, **options: str) -> livekit_openai.TTS:
    return livekit_openai.TTS(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                              voice=voice, **options)


async def synthesize(server: Server, text: str, voice: str,
                     **options: str) -> list[SynthesizedAudio]:
    tts = livekit_tts(server, voice, **options)
    try:
        async with tts.synthesize(text) as stream:
            return [event async for event in stream]
    finally:
        await tts.aclose()


@pytest.mark.parametrize(("voice", "options"), [
    ("marin", {}),  # the plugin's defaults: gpt-4o-mini-tts, mp3 in server-sent events
    ("cedar", {}),
    ("marin", {"model": "tts-1", "response_format": "aac"}),  # ADTS bytes as they come
    ("cedar", {"response_format": "aac"}),  # aac in server-sent events
], ids=["marin-sse-mp3", "cedar-sse-mp3", "marin-aac", "cedar-sse-aac"])
def test_livekit_speaks_a_sentence_in_24khz_frames_as_long_as_the_service_does(
        server: Server, voice: str, options: dict[str, str]) -> None:
    events = asyncio.run(synthesize(server, SENTENCE, voice, **options))
    assert events
    frames = [event.frame for event in events]
    assert {(frame.sample_rate, frame.num_channels) for frame in frames} == {
        (OPENAI_PCM_RATE_HZ, 1)}
    assert events[-1].is_final
    assert_sounds_like_the_service(server, sum(frame.duration for frame in frames), SENTENCE,
                                   voice)


async def synthesize_and_close_at_first_audio(server: Server, text: str,
                                              voice: str) -> tuple[list[SynthesizedAudio],
                                                                   list[SynthesizedAudio]]:
    """The events before and after closing the ``ChunkedStream`` at its first audio, as an
    agent does when the user talks over it."""
    tts = livekit_tts(server, voice)
    try:
        stream = tts.synthesize(text)
        heard = [await stream.__anext__()]
        await stream.aclose()
        after = [event async for event in stream]
        assert stream.done
        return heard, after
    finally:
        await tts.aclose()


def test_livekit_aclose_stops_the_audio_and_closes_the_http_stream(server: Server) -> None:
    before = engine_stats(server)
    heard, after = asyncio.run(synthesize_and_close_at_first_audio(server, LONG_TEXT, "cedar"))
    assert heard[0].frame.samples_per_channel > 0
    assert after == []
    assert_cut_short_by_the_client(server, before)
