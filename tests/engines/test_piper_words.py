"""Word times on the Piper engine (``SpeechRequest.word_times``): from the voice's own phoneme
durations, so they must fall on the audio the engine sends."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from serve_app.engines.base import AudioChunk, SpeechRequest
from serve_app.engines.piper.piper_engine import PiperEngine
from serve_app.engines.piper.piper_words import WordLabeler
from serve_app.engines.registry import create_engine
from serve_app.engines.words import WordTime, split_words, spoken_by

# Joined words ("of the"), expansions (numbers, "Dr."), a hyphen, commas and three sentences.
TEXT = ("Of the 1887 letters, Dr. Smith kept twelve. The rest, well-known ones included, "
        "went to the archive in 2024! Nobody asked why.")


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    engine = create_engine("piper", {"intra_op_threads": 2, "max_batch_size": 4})
    assert isinstance(engine, PiperEngine)
    yield engine
    engine.close()


async def _chunks(engine: PiperEngine, request: SpeechRequest) -> list[AudioChunk]:
    [stream] = engine.submit([request])
    return [chunk async for chunk in stream]


def _words(chunks: list[AudioChunk]) -> list[WordTime]:
    return [word for chunk in chunks for word in chunk.words]


def _rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio)))) if audio.size else 0.0


def check_words(chunks: list[AudioChunk], text: str) -> list[WordTime]:
    """Every word once, in order, each in the chunk its audio starts in, inside the audio."""
    words = _words(chunks)
    assert [word.word for word in words] == split_words(text)
    offset = 0
    rate = chunks[0].sample_rate_hz
    for chunk in chunks:
        for word in chunk.words:
            assert offset / rate <= word.start_s < (offset + len(chunk.samples)) / rate
        offset += len(chunk.samples)
    assert all(0 <= word.start_s < word.end_s <= offset / rate for word in words)
    assert all(a.end_s <= b.start_s for a, b in zip(words, words[1:]))
    return words


def test_words_cover_the_text_in_order_inside_their_chunks(engine: PiperEngine) -> None:
    chunks = asyncio.run(_chunks(engine, SpeechRequest("w", TEXT, seed=1, word_times=True)))
    assert len(chunks) >= 3  # one per sentence at least: times cross chunk boundaries
    check_words(chunks, TEXT)


def test_pauses_at_commas_and_sentence_ends_fall_between_the_words_and_are_quiet(
        engine: PiperEngine) -> None:
    chunks = asyncio.run(_chunks(engine, SpeechRequest("p", TEXT, seed=1, word_times=True)))
    audio = np.concatenate([chunk.samples for chunk in chunks])
    rate = chunks[0].sample_rate_hz
    words = check_words(chunks, TEXT)
    spoken = _rms(np.concatenate([audio[int(w.start_s * rate):int(w.end_s * rate)]
                                  for w in words]))
    pauses = [(a, b) for a, b in zip(words, words[1:]) if a.word[-1] in ",.!?"]
    assert len(pauses) == 6  # espeak-ng ends a sentence at "Dr." too
    for before, after in pauses:
        gap = audio[int(before.end_s * rate):int(after.start_s * rate)]
        assert len(gap) >= 0.05 * rate, (before, after)  # a pause, not a word break
        assert _rms(gap) < 0.2 * spoken, (before, after)
    breaks = [after.start_s - before.end_s for before, after in zip(words, words[1:])
              if before.word[-1] not in ",.!?"]
    assert max(breaks) < min(b.start_s - a.end_s for a, b in pauses)


def test_without_word_times_chunks_carry_no_words_and_the_audio_is_the_same(
        engine: PiperEngine) -> None:
    plain = asyncio.run(_chunks(engine, SpeechRequest("a", TEXT, seed=2)))
    timed = asyncio.run(_chunks(engine, SpeechRequest("b", TEXT, seed=2, word_times=True)))
    assert all(chunk.words == () for chunk in plain)
    np.testing.assert_array_equal(np.concatenate([c.samples for c in plain]),
                                  np.concatenate([c.samples for c in timed]))


def test_streamed_text_gets_word_times_across_its_clauses(engine: PiperEngine) -> None:
    async def run() -> list[AudioChunk]:
        [stream] = engine.submit([SpeechRequest("s", "", seed=1, text_input="streamed",
                                                word_times=True)])
        for delta in ("Of the 1887 letters, ", "Dr. Smith kept twelve. ", "Nobody asked why."):
            engine.feed_text("s", delta)
        engine.feed_text("s", "", done=True)
        return [chunk async for chunk in stream]

    check_words(asyncio.run(run()), "Of the 1887 letters, Dr. Smith kept twelve. Nobody asked why.")


def test_max_audio_s_keeps_only_words_begun_and_ends_them_with_the_audio(
        engine: PiperEngine) -> None:
    chunks = asyncio.run(_chunks(engine, SpeechRequest("m", TEXT, seed=1, word_times=True,
                                                       max_audio_s=2.0)))
    words = _words(chunks)
    assert words and [w.word for w in words] == split_words(TEXT)[:len(words)]
    assert len(words) < len(split_words(TEXT))
    assert all(w.start_s < 2.0 and w.end_s <= 2.0 for w in words)


def test_labels_split_words_espeak_joins_and_keep_expanded_ones_whole(
        engine: PiperEngine) -> None:
    voice = engine._voice
    text = "Of the 1887 letters."
    sentences = voice.phonemize(text)
    assert " " not in "".join(sentences[0]).split(" ")[0] and "ʌvðə" in "".join(sentences[0])
    words, labels = WordLabeler(voice.phonemize).label(text, sentences)
    assert words == ["Of", "the", "1887", "letters."]
    joined = "".join(sentences[0]).index("ʌvðə")
    assert labels[0][joined] == 0 and labels[0][joined + 3] == 1  # "ʌv" | "ðə"
    number = [i for i, label in enumerate(labels[0]) if label == 2]
    assert "".join(sentences[0][number[0]:number[-1] + 1]).count(" ") >= 2  # several espeak words
    assert [label for label in labels[0] if label is not None] == sorted(
        label for label in labels[0] if label is not None)


def test_a_word_is_a_run_with_something_spoken_in_it() -> None:
    assert split_words("Hello, world — it's 5 o'clock... ok?! 🙂 & …") == [
        "Hello,", "world", "it's", "5", "o'clock...", "ok?!", "🙂"]
    words = [WordTime("a", 0.0, 0.5), WordTime("b", 0.6, 1.0), WordTime("c", 1.1, 1.5)]
    assert [w.word for w in spoken_by(words, 1.0)] == ["a", "b"]
    assert spoken_by(words, 0.4) == []
