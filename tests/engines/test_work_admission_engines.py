"""Both engines admit by work: offered far more than they can speak, they refuse the excess at
submission (or, MiniCPM-o, once a queued stream's first audio could no longer come in time),
before any work on it, and every stream they admitted is spoken to its end.

However fast the machine, ten times the slots is more than the gate can admit: a kind's cost
never falls below a quarter of its prior (slot admission's), so at most four times the slots
fit; how many fit within that depends on the machine, so the tests count, not predict."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from serve_app.engines.base import EngineOverloadedError, InvalidRequestError, SpeechRequest
from serve_app.engines.registry import create_engine
from serve_app.engines.work_admission import REFUSAL_REASONS
from tests.engines.contract import Sink

TEXT = "Admission by work keeps what it admits in real time."
SLOTS = 2
OFFERED = 10 * SLOTS
HANG_GUARD_S = 600
_ids = itertools.count()


@pytest.fixture(scope="module", params=["minicpmo", "piper"])
def engine(request):
    if request.param == "minicpmo":
        from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
        from serve_app.engines.minicpmo.model.loader import load_speech_model

        checkpoint = request.getfixturevalue("tiny_checkpoint")
        model = load_speech_model(str(checkpoint), device="cpu", dtype=torch.float32)
        engine = MiniCPMOEngine(model, EngineOptions(
            model=str(checkpoint), device="cpu", dtype="float32", max_slots=SLOTS,
            max_chat_slots=1, tts_max_positions=1024, llm_max_positions=256,
            tts_sampling="greedy", admission="work", first_audio_deadline_s=0.5))
    else:
        engine = create_engine("piper", {"intra_op_threads": 2, "max_batch_size": SLOTS,
                                         "admission": "work"})
    yield engine
    engine.close()


def request() -> SpeechRequest:
    return SpeechRequest(request_id=f"work-{next(_ids)}", text=TEXT, mode="read")


def test_offered_ten_times_its_slots_an_engine_refuses_the_excess_and_speaks_the_rest(engine):
    async def offer() -> tuple[Sink, list[str], int]:
        sink = Sink()
        admitted, refused_at_once = [], 0
        for _ in range(OFFERED):
            one = request()
            try:
                engine.submit_to([one], sink)
                admitted.append(one.request_id)
            except EngineOverloadedError as refusal:
                assert refusal.reason in ("work", "queue", "slots")
                refused_at_once += 1
        await asyncio.wait_for(sink.wait_ended(*admitted), HANG_GUARD_S)
        return sink, admitted, refused_at_once

    before = engine.stats()
    sink, admitted, refused_at_once = asyncio.run(offer())
    after = engine.stats()
    spoken = [r for r in admitted if not isinstance(sink.of(r)[-1], BaseException)]
    late = [r for r in admitted if isinstance(sink.of(r)[-1], EngineOverloadedError)]
    for request_id in late:  # refused while queued: that error is its only item, no audio
        assert len(sink.of(request_id)) == 1
        assert sink.of(request_id)[0].reason == "wait"
    assert len(spoken) + len(late) == len(admitted)  # nothing failed, nothing was cut
    assert all(sum(len(c.samples) for c in sink.of(r)) > 0 for r in spoken)
    assert 1 <= len(spoken) <= 4 * SLOTS
    assert refused_at_once + len(late) == OFFERED - len(spoken) > 0
    refused = sum(getattr(after, f"refused_{reason}") - getattr(before, f"refused_{reason}")
                  for reason in REFUSAL_REASONS)
    assert refused == OFFERED - len(spoken)
    assert after.completed - before.completed == len(spoken)
    # every admitted stream gave its work back: the engine has room again
    assert after.active_streams == after.queued_streams == 0
    assert after.work_load < after.work_limit
    assert after.headroom("read") >= 1


def test_a_refused_submission_touches_nothing(engine):
    async def offer() -> None:
        sink = Sink()
        held = []
        with pytest.raises(EngineOverloadedError):
            for _ in range(OFFERED):
                one = request()
                engine.submit_to([one], sink)
                held.append(one.request_id)
        before = engine.stats()
        batch = [request(), request(), request()]
        with pytest.raises(EngineOverloadedError):
            engine.submit_to(batch, sink)
        after = engine.stats()
        assert after.admitted_streams == before.admitted_streams
        assert sum(getattr(after, f"refused_{reason}") - getattr(before, f"refused_{reason}")
                   for reason in REFUSAL_REASONS) == 3
        assert not any(sink.of(one.request_id) for one in batch)
        for request_id in held:
            engine.abort(request_id)
        await asyncio.wait_for(sink.wait_ended(*held), HANG_GUARD_S)

    asyncio.run(offer())
    assert engine.stats().work_load < engine.stats().work_limit


def test_a_batch_at_overload_is_admitted_and_refused_request_by_request(engine):
    """The served path submits ``@serve.batch`` batches (``engine_process.submit_each``): at
    overload the engine admits what fits and refuses the rest of the batch, each request
    alone, and an invalid request in it is refused for what it is, not for load; nothing it
    refused was started, and what it admitted is spoken to its end."""
    from serve_app.gpu.engine_process import submit_each

    async def offer() -> None:
        sink = Sink()
        batch = [request() for _ in range(OFFERED)]
        batch.insert(1, SpeechRequest(request_id=f"work-{next(_ids)}", text=TEXT,
                                      voice="no-such-voice"))
        outcomes = submit_each(engine, batch, sink)
        assert isinstance(outcomes[1], InvalidRequestError)
        admitted = [one.request_id for one, outcome in zip(batch, outcomes) if outcome is None]
        refused = [one for one, outcome in zip(batch, outcomes)
                   if isinstance(outcome, EngineOverloadedError)]
        assert admitted and refused
        assert len(admitted) + len(refused) == OFFERED
        assert all(outcome.reason in ("work", "queue", "slots")
                   for outcome in outcomes if isinstance(outcome, EngineOverloadedError))
        await asyncio.wait_for(sink.wait_ended(*admitted), HANG_GUARD_S)
        assert not any(sink.of(one.request_id) for one in refused)
        assert not sink.of(batch[1].request_id)
        for request_id in admitted:
            assert len(sink.of(request_id)) >= 1

    asyncio.run(offer())
    assert engine.stats().work_load < engine.stats().work_limit
