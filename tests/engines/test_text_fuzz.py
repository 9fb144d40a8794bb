"""Hostile and odd text straight into both engines (Piper; MiniCPM-o on the tiny checkpoint).

For any text, an engine either refuses it with ``InvalidRequestError`` before admission
(nothing scheduled, no slot taken) or streams audio (some samples, a final chunk) and frees the
slot. Examples are derandomized (the same on every run) and the strings that once failed are
tried first.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

from serve_app.engines.base import InvalidRequestError, SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.loader import load_speech_model
from serve_app.engines.registry import create_engine
from tests.text_cases import ONCE_FAILED, SPEAKS, hostile_text

pytestmark = pytest.mark.slow

EXAMPLES = 40
_ids = itertools.count()


@pytest.fixture(scope="module")
def piper():
    engine = create_engine("piper", {"intra_op_threads": 2, "max_batch_size": 4})
    engine.warmup()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def minicpmo(tiny_checkpoint):
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                            admission="slots", max_slots=4, max_chat_slots=2, tts_max_positions=1024,
                            llm_max_positions=256, tts_sampling="greedy")
    engine = MiniCPMOEngine(model, options)
    yield engine
    engine.close()


async def speak_or_refuse(engine, text: str) -> str:
    """One request through the engine's contract; asserts what either outcome must leave."""
    request = SpeechRequest(request_id=f"fuzz-{next(_ids)}", text=text)
    before = engine.stats()
    try:
        engine.validate(request)
    except InvalidRequestError:
        with pytest.raises(InvalidRequestError):
            engine.submit([request])
        after = engine.stats()
        assert (after.steps, after.active_streams, after.queued_streams) == (before.steps, 0, 0)
        return "refused"
    [stream] = engine.submit([request])
    chunks = [chunk async for chunk in stream]
    assert chunks and chunks[-1].final, repr(text)
    assert sum(len(chunk.samples) for chunk in chunks) > 0, repr(text)
    after = engine.stats()
    # The slot is free once the final chunk is out (MiniCPM-o counts "completed" just after).
    assert (after.active_streams, after.queued_streams) == (0, 0)
    assert (after.failed, after.aborted) == (before.failed, before.aborted)
    return "spoke"


def fuzz(engine) -> Counter:
    outcomes: Counter = Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(text=hostile_text)
    def check(text: str) -> None:
        outcomes[asyncio.run(speak_or_refuse(engine, text))] += 1

    for text in ONCE_FAILED + SPEAKS:
        check = example(text=text)(check)
    check()
    return outcomes


def test_piper_refuses_before_admission_or_speaks_and_frees_the_slot(piper) -> None:
    outcomes = fuzz(piper)
    assert outcomes["refused"] >= len(ONCE_FAILED) and outcomes["spoke"] >= len(SPEAKS)


def test_minicpmo_refuses_before_admission_or_speaks_and_frees_the_slot(minicpmo) -> None:
    outcomes = fuzz(minicpmo)
    assert outcomes["refused"] >= len(ONCE_FAILED) and outcomes["spoke"] >= 1
