"""Word times on the MiniCPM-o engine (tiny checkpoint, CPU): the mechanics of placing each word
where its text is released to the TTS. Random weights say nothing of accuracy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from serve_app.engines.base import LengthControls, SpeechRequest
from serve_app.engines.minicpmo.word_times import ReleasedWords
from serve_app.engines.words import split_words
from tests.engines.minicpmo.tiny_engine import module_engine

TEXT = ("Word times follow the text as it reaches the model, piece by piece. "
        "A second sentence gives the schedule another call or two.")
FRAMES = LengthControls(audio_frames=120)  # random weights never stop by themselves

pytestmark = pytest.mark.timeout(900)  # guards against a hang only; nothing here is timed
engine = module_engine(max_slots=2, max_chat_slots=1)


async def _chunks(engine, request: SpeechRequest) -> list:
    [stream] = engine.submit([request])
    return [chunk async for chunk in stream]


def test_words_are_in_order_inside_the_chunk_their_text_came_with(engine) -> None:
    timed = asyncio.run(_chunks(engine, SpeechRequest("timed", TEXT, lengths=FRAMES,
                                                      word_times=True)))
    plain = asyncio.run(_chunks(engine, SpeechRequest("plain", TEXT, lengths=FRAMES)))
    assert all(chunk.words == () for chunk in plain)
    np.testing.assert_array_equal(np.concatenate([c.samples for c in timed]),
                                  np.concatenate([c.samples for c in plain]))  # greedy
    words = [word for chunk in timed for word in chunk.words]
    assert words and [w.word for w in words] == split_words(TEXT)[:len(words)]
    rate, offset = timed[0].sample_rate_hz, 0
    for chunk in timed:
        # A chunk's words are the text released with it, so they agree with its text.
        assert " ".join(w.word for w in chunk.words) in " ".join(split_words(
            "".join(c.text for c in timed)))
        for word in chunk.words:
            assert offset / rate <= word.start_s < word.end_s <= (offset + len(chunk.samples)) / rate
        offset += len(chunk.samples)
    assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(words, words[1:]))


def test_streamed_text_and_refusals(engine) -> None:
    async def run():
        [stream] = engine.submit([SpeechRequest("fed", "", text_input="streamed",
                                                lengths=FRAMES, word_times=True)])
        for delta in ("Word times follow the te", "xt as it reaches the model, ",
                      "piece by piece."):
            engine.feed_text("fed", delta)
        engine.feed_text("fed", "", done=True)
        return [chunk async for chunk in stream]

    words = [w.word for chunk in asyncio.run(run()) for w in chunk.words]
    expected = split_words("Word times follow the text as it reaches the model, piece by piece.")
    assert words == expected  # all of it (the text fits the frames), "text" whole though cut


def test_a_word_cut_between_pieces_waits_for_its_rest() -> None:
    clock = ReleasedWords(100)
    [hello] = clock.chunk("Hello wor", 100, following="ld again")
    assert (hello.word, hello.start_s, hello.end_s) == ("Hello", 0.0, 1.0)
    [world] = clock.chunk("ld", 50, following=" again")  # "world" ends where " again" begins
    assert (world.word, world.start_s, world.end_s) == ("world", 1.0, 1.5)
    assert clock.chunk(" ag", 50, following="ain") == ()
    assert clock.chunk("ain", 50, following=None) == ()  # more text may still come
    [again] = clock.chunk("", 0, following="")
    assert again.word == "again"
