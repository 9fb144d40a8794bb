"""Streamed text input on the Piper engine (the real voice): clauses are spoken as they
complete, before the input ends: what its chunks hold (what every engine does with streamed text
is in test_engine_contract_text_input.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from piper.config import SynthesisConfig

from serve_app.engines.base import SpeechRequest
from serve_app.engines.piper.piper_engine import PiperEngine
from serve_app.engines.registry import create_engine

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
