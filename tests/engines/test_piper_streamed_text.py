"""Streamed text input on the Piper engine (the real voice): clauses are spoken as they
complete, before the input ends."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from piper.config import SynthesisConfig

from serve_app.engines.base import InvalidRequestError, RequestAbortedError, SpeechRequest
from serve_app.engines.piper.piper_engine import PiperEngine
from serve_app.engines.registry import create_engine
from serve_app.engines.streamed_text import MAX_CLAUSE_CHARS, complete_clauses
from tests.engines.streams import (
    FEED_ERROR_CODES,
    feed_error_codes,
    finish_while_one_waits,
)

pytestmark = pytest.mark.timeout(600)  # guards against a hang only; nothing here is timed

# 136 characters with commas only: no sentence end, and the input stays open
COMMAS_ONLY = ("Well, if you want the short version, we drove north, then east, then north again, "
               "past the lake, the old mill, and the long stone bridge")
# A stream that waits for more text gets none within this (the WebSocket's idle timeout is 20 s):
# without a cut at commas or at the length cap, the test fails here instead of hanging.
FIRST_AUDIO_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    engine = create_engine("piper", {"intra_op_threads": 2, "max_batch_size": 4})
    yield engine
    engine.close()


def streamed(request_id: str, text: str = "", **fields) -> SpeechRequest:
    return SpeechRequest(request_id, text, text_input="streamed", **fields)


def noise_free(engine: PiperEngine, text: str) -> np.ndarray:
    return np.concatenate([piece.audio_float_array for piece in engine._voice.synthesize(
        text, SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0))])


def test_complete_clauses() -> None:
    assert complete_clauses("One. Two; three: four", False) == (["One.", " Two;", " three:"],
                                                                 " four")
    assert complete_clauses("Pi is 3.14 and", False) == ([], "Pi is 3.14 and")
    assert complete_clauses("Ends here.", False) == (["Ends here."], "")
    assert complete_clauses("line\n next", False) == (["line\n"], " next")
    assert complete_clauses("line\n", False) == (["line\n"], "")
    assert complete_clauses(" no end", True) == ([" no end"], "")
    assert complete_clauses("  ", True) == ([], "")


def test_each_clause_is_spoken_as_it_completes(engine: PiperEngine) -> None:
    async def run():
        (stream,) = engine.submit([streamed("clauses", "Hello from a streamed ", seed=1)])
        engine.feed_text("clauses", "request. And this clause is not")
        first = await anext(stream)  # the input is open: this is the first clause alone
        engine.feed_text("clauses", " finished yet!", done=True)
        return first, [chunk async for chunk in stream]

    first, rest = asyncio.run(run())
    assert not first.final
    np.testing.assert_allclose(first.samples, noise_free(engine, "Hello from a streamed request."),
                               atol=1e-4)
    assert rest[-1].final and sum(len(chunk.samples) for chunk in rest) > 0


def test_a_stream_waiting_for_text_does_not_hold_up_others(engine: PiperEngine) -> None:
    other = SpeechRequest("other", "A whole request.")
    (other_chunks, other_error), (waiting_chunks, waiting_error) = asyncio.run(
        finish_while_one_waits(engine, streamed("waiting"), other, "Now it speaks."))
    assert other_error is None and other_chunks >= 1
    assert waiting_error is None and waiting_chunks >= 1


def test_input_that_ends_empty_ends_the_stream_with_one_empty_final_chunk(engine) -> None:
    async def run():
        (stream,) = engine.submit([streamed("empty")])
        engine.feed_text("empty", "", done=True)
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert [chunk.final for chunk in chunks] == [True] and len(chunks[0].samples) == 0


def test_feed_errors(engine: PiperEngine) -> None:
    whole = SpeechRequest("whole", "Whole text.")
    codes = asyncio.run(feed_error_codes(engine, whole, streamed("errors", "Some text.")))
    assert codes == FEED_ERROR_CODES


def test_abort_of_a_streamed_request_frees_its_slot(engine: PiperEngine) -> None:
    async def run():
        (stream,) = engine.submit([streamed("aborted", "A first clause. And then")])
        first = await anext(stream)
        engine.abort("aborted")
        with pytest.raises(RequestAbortedError):
            await anext(stream)
        with pytest.raises(InvalidRequestError):
            engine.feed_text("aborted", "more")
        return first, engine.stats().active_streams

    first, active = asyncio.run(run())
    assert len(first.samples) > 0 and active == 0


async def first_audio_while_input_is_open(engine: PiperEngine, request_id: str, text: str):
    (stream,) = engine.submit([streamed(request_id, seed=1)])
    engine.feed_text(request_id, text)  # never done
    try:
        return await asyncio.wait_for(anext(stream), FIRST_AUDIO_WITHIN_S)
    finally:
        engine.abort(request_id)


def test_text_with_commas_only_is_spoken_before_the_input_ends(engine: PiperEngine) -> None:
    assert len(COMMAS_ONLY) == 136
    first = asyncio.run(first_audio_while_input_is_open(engine, "commas", COMMAS_ONLY))
    assert not first.final
    np.testing.assert_allclose(first.samples, noise_free(engine, "Well,"), atol=1e-4)


def test_a_long_run_without_any_break_is_spoken_before_the_input_ends(engine: PiperEngine) -> None:
    run = " ".join(["and then we walked a little further along the old road"] * 3)
    assert len(run) > MAX_CLAUSE_CHARS and not complete_clauses(run[:MAX_CLAUSE_CHARS], False)[0]
    first = asyncio.run(first_audio_while_input_is_open(engine, "no-break", run))
    assert not first.final and len(first.samples) > 0
