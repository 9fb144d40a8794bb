"""The batched engine reproduces the upstream MiniCPM-o streaming speech path exactly."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from serve_app.engines.base import InvalidRequestError, SamplingParams, SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine, StreamPlan
from serve_app.engines.minicpmo.model.loader import load_speech_model
from tests.golden.checkpoint import load_expected, load_manifest
from tests.engines.minicpmo.tiny_engine import tiny_engine

GOLDEN_PROMPT = "<|im_start|>user\nHi, how are you?<|im_end|>\n"
STREAM_CASES = ["stream_short", "stream_medium", "stream_read", "stream_long"]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = tiny_engine(tiny_checkpoint, max_slots=8, max_chat_slots=4)
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=[
    {"steps_per_sync": 1},
    {"steps_per_sync": 7, "one_query_attention": "matmul"},
    {"one_query_attention": "flex"},
    {"one_query_attention": "visible_ranges"},
], ids=["sync-every-frame", "sync-every-7-frames-matmul-attention", "flex-attention",
        "visible-ranges-attention"])
def window_engine(request, tiny_checkpoint):
    """The engine with other step options: ``steps_per_sync`` 1 syncs after every frame (the
    default is 5); 7 does not divide the 25-frame call, so calls end inside a window; decode
    attention as two matmuls, as FlexAttention over the key blocks each row sees, or over the
    two ranges of keys each row sees (on the CPU: SDPA over the ranges' mask, so the ranges the
    audio step derives are what is checked), instead of torch's fused kernel."""
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                            admission="slots", max_slots=4,
                            max_chat_slots=2, tts_max_positions=1024, llm_max_positions=256,
                            tts_sampling="greedy", keep_traces=True, **request.param)
    engine = MiniCPMOEngine(model, options)
    yield engine
    engine.close()


def golden_plan(case: str, request_id: str) -> StreamPlan:
    pieces = load_manifest()["cases"][case]["text_pieces"]
    request = SpeechRequest(request_id=request_id, text="".join(pieces), mode="read")
    return StreamPlan(request, GOLDEN_PROMPT, list(pieces))


async def collect(stream) -> np.ndarray:
    parts = [chunk.samples async for chunk in stream]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def golden_codes_by_call(schedule) -> list[np.ndarray]:
    """Cumulative segment codes after each generate call, as the golden files store them."""
    segments = list(schedule.finished_segments)
    calls, segment_index, previous = [], 0, 0
    for length in schedule.call_lengths:
        if length < previous:
            segment_index += 1
        calls.append(np.asarray(segments[segment_index][:length]).reshape(-1, 4))
        previous = length
    return calls


def expected_codes_by_call(expected) -> list[np.ndarray]:
    bounds = np.cumsum(expected["call_code_lengths"])[:-1]
    return np.split(expected["codes"], bounds)


def test_speaker_hidden_state_matches_upstream(engine):
    expected = load_expected("stream_short")
    tok = engine.model.tokenizer
    ids = expected["prefill_ids"].tolist() + expected["gen_ids"].tolist()
    assert tok(GOLDEN_PROMPT, add_special_tokens=False)["input_ids"] == expected["prefill_ids"].tolist()
    assert engine._gen_prompt_ids == expected["gen_ids"].tolist()
    from serve_app.engines.minicpmo.model.layers import SlotKVCache, StepInputs, causal_attend

    cache = SlotKVCache(engine.model.config.llm, 1, len(ids), torch.device("cpu"), torch.float32)
    positions = torch.arange(len(ids))[None]
    valid = torch.ones_like(positions, dtype=torch.bool)
    step = StepInputs(torch.tensor([0]), positions, positions, causal_attend(positions, valid, len(ids) + 1))
    with torch.inference_mode():
        hidden = engine.model.llm.hidden_states(torch.tensor([ids]), cache, step)
    spk = ids.index(engine._spk_id)
    np.testing.assert_allclose(hidden[0, spk].numpy(), expected["spk_hidden"][0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", STREAM_CASES)
def test_stream_matches_upstream_codes_and_waveform(engine, case):
    expected = load_expected(case)
    request_id = f"golden-{case}"

    async def run():
        (stream,) = engine.submit_plans([golden_plan(case, request_id)])
        return await collect(stream)

    wav = asyncio.run(run())
    schedule = engine.trace(request_id)
    got_calls = golden_codes_by_call(schedule)
    want_calls = expected_codes_by_call(expected)
    assert [len(c) for c in got_calls] == [len(c) for c in want_calls]
    for index, (got, want) in enumerate(zip(got_calls, want_calls)):
        assert np.array_equal(got, want), f"codes differ after call {index}"
    assert wav.shape == expected["wav"].shape
    np.testing.assert_allclose(wav, expected["wav"], rtol=1e-4, atol=1e-5)


def test_codes_do_not_depend_on_frames_per_host_sync(window_engine):
    """Chaining audio steps on the device changes when the host looks, not what is made."""
    cases = ["stream_medium", "stream_long"]

    async def run():
        streams = [engine_stream for case in cases for engine_stream in
                   window_engine.submit_plans([golden_plan(case, f"window-{case}")])]
        return await asyncio.gather(*(collect(stream) for stream in streams))

    waves = asyncio.run(run())
    for case, wav in zip(cases, waves):
        expected = load_expected(case)
        got = np.concatenate(golden_codes_by_call(window_engine.trace(f"window-{case}")))
        assert np.array_equal(got, expected["codes"]), case
        np.testing.assert_allclose(wav, expected["wav"], rtol=1e-4, atol=1e-5)


def test_each_case_is_unchanged_when_batched_with_others(engine):
    """Mixed modes, staggered arrivals, one stream aborted midway: codes and audio as alone."""
    alone = {case: load_expected(case) for case in STREAM_CASES}

    async def run():
        results: dict[str, np.ndarray] = {}
        stats_before = engine.stats()
        chat = SpeechRequest(request_id="batch-chat", text="Tell me about rivers.", mode="chat",
                             sampling=SamplingParams(temperature=0.0, max_new_tokens=30))
        victim = SpeechRequest(request_id="batch-victim", text="This one is cut off. " * 20, mode="read")
        (chat_stream, victim_stream) = engine.submit([chat, victim])
        tasks = {}
        for index, case in enumerate(STREAM_CASES):
            (stream,) = engine.submit_plans([golden_plan(case, f"batch-{case}")])
            tasks[case] = asyncio.create_task(collect(stream))
            await asyncio.sleep(0.05 * index)  # staggered: later cases join mid-flight
        first = await victim_stream.__anext__()
        assert len(first.samples) > 0
        engine.abort("batch-victim")
        with pytest.raises(Exception):
            async for _ in victim_stream:
                pass
        chat_audio = await collect(chat_stream)
        for case, task in tasks.items():
            results[case] = await task
        return results, chat_audio, stats_before

    results, chat_audio, stats_before = asyncio.run(run())
    for case in STREAM_CASES:
        schedule = engine.trace(f"batch-{case}")
        got = np.concatenate(golden_codes_by_call(schedule))
        assert np.array_equal(got, alone[case]["codes"]), case
        np.testing.assert_allclose(results[case], alone[case]["wav"], rtol=1e-4, atol=1e-5)
    assert len(chat_audio) > 0
    stats = engine.stats()
    assert stats.max_batch_size_seen > 1
    assert stats.aborted == stats_before.aborted + 1
    assert stats.active_streams == 0


# MiniCPM-o's own limits; what every engine refuses is in tests/engines/test_engine_contract.py.
@pytest.mark.parametrize("request_fields, param", [
    ({"text": "?!... \U0001F600"}, "text"),
    ({"text": "Hello.", "mode": "chat", "sampling": SamplingParams(temperature=-1.0)}, "temperature"),
    ({"text": "Hello.", "mode": "chat", "sampling": SamplingParams(top_p=0.0)}, "top_p"),
    ({"text": "Hello.", "mode": "chat", "sampling": SamplingParams(top_k=0)}, "top_k"),
])
def test_bad_input_is_refused_before_it_takes_a_slot(engine, request_fields, param):
    before = engine.stats()

    async def run():
        with pytest.raises(InvalidRequestError) as raised:
            engine.submit([SpeechRequest(request_id=f"bad-{param}", **request_fields)])
        return raised.value

    error = asyncio.run(run())
    assert error.param == param
    after = engine.stats()
    assert (after.active_streams, after.queued_streams) == (0, 0)
    assert after.completed == before.completed and after.failed == before.failed
