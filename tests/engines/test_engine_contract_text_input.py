"""The engine contract (tests/engines/test_engine_contract.py) for streamed text in
(``feed_text``): an open input is spoken as its text comes, in parts as at once, and the feeding
errors are the same on every engine."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from serve_app.engines.streamed_text import MAX_CLAUSE_CHARS, clause_ends
from tests.engines.contract import (FRAMES, SPEAKABLE_START, assert_quiet, audio, chunks_of,
                                    contract_engines, drain_guarded, first_chunk, rid, streamed,
                                    whole)
from tests.engines.streams import FEED_ERROR_CODES, feed_error_codes, finish_while_one_waits

pytestmark = pytest.mark.timeout(900)  # guards against a hang only; nothing here is timed

engine = contract_engines()


OPEN_INPUTS = {
    "sentence-end": SPEAKABLE_START,
    "commas-only": "Well, you see, I",
    "commas-only-long": ("Well, if you want the short version, we drove north, then east, then "
                         "north again, past the lake, the old mill, and the long stone bridge"),
    "no-break": " ".join(["and then we walked a little further along the old road"] * 3),
}


@pytest.mark.parametrize("case", OPEN_INPUTS, ids=list(OPEN_INPUTS))
def test_streamed_text_is_spoken_before_the_input_ends(engine, case: str) -> None:
    """By the streamed-text rule: text with a break in it, or a run past the cap, starts to be
    spoken while the input is still open (no ``done`` ever comes here)."""
    text = OPEN_INPUTS[case]
    assert clause_ends(text)  # the rule has a piece here
    if case == "no-break":
        assert len(text) > MAX_CLAUSE_CHARS and not clause_ends(text[:MAX_CLAUSE_CHARS])
    request = streamed(rid(case))

    async def run():
        (stream,) = engine.submit([request])
        engine.feed_text(request.request_id, text)  # never done
        head = await first_chunk(stream)
        engine.abort(request.request_id)
        return head, await drain_guarded(stream)

    head, _ = asyncio.run(run())
    assert not head.final and len(head.samples) > 0
    assert_quiet(engine)


def test_text_fed_in_parts_is_spoken_as_the_same_text_fed_at_once(engine) -> None:
    text = ("Streaming text arrives a few words at a time, and the speech follows it closely. "
            "Nothing here waits for the last word.")
    # cut inside words only: where a delta ends is never a break the whole text lacks
    cuts = [0, 5, 12, 33, 43, 95, len(text)]
    assert all(text[c - 1].isalpha() and text[c].isalpha() for c in cuts[1:-1])

    async def run(request_id: str, deltas: list[str]):
        (stream,) = engine.submit([streamed(request_id, max_audio_s=None, lengths=FRAMES)])
        for delta in deltas:
            engine.feed_text(request_id, delta)
        engine.feed_text(request_id, "", done=True)
        return await chunks_of(stream)

    at_once = asyncio.run(run(rid("at-once"), [text]))
    in_parts = asyncio.run(run(rid("in-parts"), [text[a:b] for a, b in zip(cuts, cuts[1:])]))
    assert at_once[-1].final and in_parts[-1].final
    assert len(audio(in_parts)) == len(audio(at_once)) > 0
    np.testing.assert_allclose(audio(in_parts), audio(at_once), atol=1e-4)


def test_text_at_submission_and_fed_text_are_spoken_in_one_stream(engine) -> None:
    request = streamed(rid("head-and-rest"), "Hello from a streamed ", max_audio_s=None,
                       lengths=FRAMES)

    async def run():
        (stream,) = engine.submit([request])
        engine.feed_text(request.request_id, "request. And the rest.", done=True)
        return await chunks_of(stream)

    chunks = asyncio.run(run())
    assert [chunk.final for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(audio(chunks)) > engine.sample_rate_hz // 2
    assert {chunk.request_id for chunk in chunks} == {request.request_id}


def test_a_stream_waiting_for_text_does_not_hold_up_others(engine) -> None:
    other = whole(rid("other"), "A whole request.")
    (other_chunks, other_error), (waiting_chunks, waiting_error) = asyncio.run(
        finish_while_one_waits(engine, streamed(rid("waiting")), other, "Now it speaks."))
    assert other_error is None and other_chunks >= 1
    assert waiting_error is None and waiting_chunks >= 1


@pytest.mark.parametrize("fed", ["", "   "], ids=["nothing", "blank"])
def test_input_that_ends_empty_ends_the_stream_with_one_empty_final_chunk(engine, fed) -> None:
    request = streamed(rid("empty"))

    async def run():
        (stream,) = engine.submit([request])
        engine.feed_text(request.request_id, fed, done=True)
        return await chunks_of(stream)

    chunks = asyncio.run(run())
    assert [chunk.final for chunk in chunks] == [True] and len(chunks[0].samples) == 0
    assert_quiet(engine)


def test_feed_errors(engine) -> None:
    """unknown id, a whole-text request, past the 4096 characters (the text at submission
    counts), after ``done``, after the stream finished."""
    codes = asyncio.run(feed_error_codes(engine, whole(rid("whole-text"), "Whole text."),
                                         streamed(rid("errors"), "Some text.")))
    assert codes == FEED_ERROR_CODES
    engine.validate(streamed(rid("empty-is-fine")))  # a streamed request may start with no text
