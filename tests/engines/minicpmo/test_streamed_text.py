"""Streamed text input on the MiniCPM-o engine (tiny checkpoint, CPU): text fed while the
request runs is spoken as it arrives, cut exactly as the whole text would be."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.engines.base import (
    InvalidRequestError,
    LengthControls,
    RequestAbortedError,
    SpeechRequest,
)
from serve_app.engines.minicpmo.engine import MiniCPMOEngine, StreamPlan
from tests.engines.minicpmo.tiny_engine import tiny_engine
from tests.engines.streams import (
    FEED_ERROR_CODES,
    drain,
    feed_error_codes,
    finish_while_one_waits,
)

TEXT = ("Streaming text arrives a few words at a time, and the speech follows it closely. "
        "Nothing here waits for the last word.")
# Random tiny weights never stop by themselves: a fixed length of several generate calls.
FRAMES = LengthControls(audio_frames=80)

pytestmark = pytest.mark.timeout(900)  # guards against a hang only; nothing here is timed


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = tiny_engine(tiny_checkpoint, max_slots=3, max_chat_slots=1)
    yield engine
    engine.close()


def streamed(request_id: str, text: str = "", **fields) -> SpeechRequest:
    return SpeechRequest(request_id, text, text_input="streamed", lengths=FRAMES, **fields)


def codes(engine: MiniCPMOEngine, request_id: str) -> tuple[list, list]:
    trace = engine.trace(request_id)
    return trace.finished_segments, trace.call_lengths


def test_audio_starts_before_the_input_is_done(engine) -> None:
    async def run():
        (stream,) = engine.submit([streamed("early")])
        engine.feed_text("early", "Streaming text arrives a few words at ")
        engine.feed_text("early", "a time, and the speech follows it closely. ")
        first = await anext(stream)  # the input is still open: this audio came before done
        engine.feed_text("early", "Nothing here waits for the last word.", done=True)
        return first, [chunk async for chunk in stream]

    first, rest = asyncio.run(run())
    assert len(first.samples) > 0 and not first.final
    assert rest[-1].final
    assert sum(len(segment) for segment in codes(engine, "early")[0]) == FRAMES.audio_frames


def test_text_fed_in_parts_gives_the_codes_of_the_whole_text(engine) -> None:
    """Deltas that split words anywhere: the pieces, and so the greedy codes, are those of the
    whole text spoken with the same prompt (the prompt holds the text known at submission)."""
    prompt = engine.plan(streamed("probe")).prompt
    pieces = engine.plan(SpeechRequest("probe", TEXT)).pieces
    deltas = [TEXT[a:b] for a, b in zip((0, 7, 9, 40, 41, 95), (7, 9, 40, 41, 95, len(TEXT)))]

    async def run():
        whole = engine.submit_plans([StreamPlan(SpeechRequest("whole", TEXT, lengths=FRAMES),
                                                prompt, pieces)])
        (parts,) = engine.submit([streamed("parts")])
        for delta in deltas:
            engine.feed_text("parts", delta)
            await asyncio.sleep(0)
        engine.feed_text("parts", "", done=True)
        return await asyncio.gather(drain(whole[0]), drain(parts))

    assert [error for _, error in asyncio.run(run())] == [None, None]
    assert codes(engine, "parts") == codes(engine, "whole")
    assert engine.trace("parts").gen_text_raw == engine.trace("whole").gen_text_raw


def test_all_text_at_submission_equals_the_whole_text_request(engine) -> None:
    async def run():
        streams = engine.submit([SpeechRequest("at-once", TEXT, lengths=FRAMES),
                                 streamed("at-once-streamed", TEXT)])
        engine.feed_text("at-once-streamed", "", done=True)
        return await asyncio.gather(*(drain(s) for s in streams))

    assert [error for _, error in asyncio.run(run())] == [None, None]
    assert codes(engine, "at-once-streamed") == codes(engine, "at-once")


def test_a_stream_waiting_for_text_does_not_hold_up_others(engine) -> None:
    other = SpeechRequest("other", "Short and whole.", lengths=FRAMES)
    (other_chunks, other_error), (waiting_chunks, waiting_error) = asyncio.run(
        finish_while_one_waits(engine, streamed("waiting"), other, "Now it speaks."))
    assert other_error is None and other_chunks >= 1
    assert waiting_error is None and waiting_chunks >= 1


def test_input_that_ends_with_nothing_speakable_ends_the_stream_without_audio(engine) -> None:
    async def run():
        (stream,) = engine.submit([streamed("silent", "...")])
        engine.feed_text("silent", " !?", done=True)
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert [chunk.final for chunk in chunks] == [True] and len(chunks[0].samples) == 0


def test_feed_errors(engine) -> None:
    whole = SpeechRequest("whole-text", "Whole text.", lengths=FRAMES)
    codes = asyncio.run(feed_error_codes(engine, whole, streamed("errors", "Some text.")))
    assert codes == FEED_ERROR_CODES
    engine.validate(streamed("empty-is-fine"))
    with pytest.raises(InvalidRequestError):
        engine.validate(streamed("chat", "Hello?", mode="chat"))


def test_abort_of_a_streamed_request_frees_its_slot(engine) -> None:
    async def run():
        (stream,) = engine.submit([streamed("aborted", TEXT[:84])])
        first = await anext(stream)  # running, and waiting for more text
        engine.abort("aborted")
        with pytest.raises(RequestAbortedError):
            await anext(stream)
        active_after_abort = engine.stats().active_streams
        with pytest.raises(InvalidRequestError):
            engine.feed_text("aborted", "more")
        # every slot is free again: as many whole requests as there are slots all finish
        streams = engine.submit([SpeechRequest(f"after-{i}", "Again.", lengths=FRAMES)
                                 for i in range(engine.options.max_slots)])
        return first, active_after_abort, await asyncio.gather(*(drain(s) for s in streams))

    first, active_after_abort, results = asyncio.run(run())
    assert len(first.samples) > 0
    assert active_after_abort == 0
    assert all(error is None for _, error in results)


def test_text_feed_cuts_the_pieces_of_the_whole_text_wherever_the_text_is_split(engine) -> None:
    text = "Caf\u00e9 na\u00efve \u4f60\u597d\u4e16\u754c. Let's go,  don't stop!\nNew line: 3.14 apples"
    whole = engine.plan(SpeechRequest("w", text)).pieces
    for size in (1, 2, 3, 5, 8, 13):
        feed = engine.plan(streamed("s")).text_feed
        got = [piece for start in range(0, len(text), size)
               for piece in feed.push(text[start:start + size])]
        assert got + feed.finish() == whole, size
