"""``packed_prefill``: the admission prompts in one row give what the padded pass gives (speaker
embeddings, the chat streams' keys and values and first-token logits), and an engine with it
speaks the same greedy chat answers and read audio."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve_app.engines.base import LengthControls, SamplingParams, SpeechRequest
from serve_app.engines.minicpmo.device.packed_prefill import PackedPrompts, packed_attend
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.loader import load_speech_model

TEXTS = ["Tell me about rivers.", "What is the tallest mountain on the whole of the earth?",
         "Hi.", "Rivers run to the sea, and the sea runs back to the rivers as rain."]


def engine_of(checkpoint, packed: bool) -> MiniCPMOEngine:
    model = load_speech_model(str(checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(checkpoint), device="cpu", dtype="float32",
                            admission="slots", max_slots=4, max_chat_slots=4,
                            tts_max_positions=1024, llm_max_positions=256,
                            tts_sampling="greedy", keep_traces=True, packed_prefill=packed)
    return MiniCPMOEngine(model, options)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    made = {packed: engine_of(tiny_checkpoint, packed) for packed in (False, True)}
    yield made
    for engine in made.values():
        engine.close()


def test_a_token_sees_its_own_prompt_up_to_itself_and_padding_sees_the_first_token():
    packed = PackedPrompts.of([[5, 6, 7], [8, 9]])
    assert packed.ids.tolist() == [5, 6, 7, 8, 9]
    assert packed.positions.tolist() == [0, 1, 2, 0, 1]
    assert packed.starts == [0, 3]
    segment = torch.cat([packed.segment, torch.tensor([-1])])
    valid = torch.tensor([True] * 5 + [False])
    visible = packed_attend(segment, valid)[0, 0].int().tolist()
    assert visible == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                       [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0]]


def test_the_packed_pass_gives_what_the_padded_pass_gives(engines):
    engine = engines[True]
    runner = engine._runner
    prompts = [engine.plan(SpeechRequest(request_id=f"p{i}", text=text, mode=mode)).prompt_ids
               + engine._gen_prompt_ids
               for i, (text, mode) in enumerate(zip(TEXTS, ["chat", "read", "chat", "read"]))]
    assert len({len(p) for p in prompts}) == 4  # padding would show
    chat_rows, llm_slots = [0, 2], [3, 1]
    results = {}
    with torch.inference_mode():
        for packed in (False, True):
            runner.packed_prefill = packed
            runner.llm_cache.all_keys.zero_()
            runner.llm_cache.all_values.zero_()
            logits = runner.prefill_prompts(prompts, [None] * 4, [0, 1, 2, 3], engine._spk_id,
                                            chat_rows, llm_slots)
            results[packed] = (logits.clone(), runner.speakers[:4].clone(),
                               [(runner.llm_cache.all_keys[:, slot, :, :len(prompts[row])].clone(),
                                 runner.llm_cache.all_values[:, slot, :, :len(prompts[row])].clone())
                                for row, slot in zip(chat_rows, llm_slots)])
    runner.packed_prefill = True
    (padded_logits, padded_speakers, padded_kv), (logits, speakers, kv) = results[False], results[True]
    torch.testing.assert_close(logits, padded_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(speakers, padded_speakers, rtol=1e-4, atol=1e-5)
    for (keys, values), (padded_keys, padded_values) in zip(kv, padded_kv):
        assert keys.abs().sum() > 0
        torch.testing.assert_close(keys, padded_keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(values, padded_values, rtol=1e-4, atol=1e-5)


def test_an_engine_with_packed_prompts_speaks_the_same(engines):
    """Read and chat streams admitted together (their prompts share one pass): the same greedy
    answers and the same audio codes with the prompts packed as padded."""
    def run(engine: MiniCPMOEngine) -> tuple[list[str], list[list]]:
        requests = [SpeechRequest(request_id=f"{mode}-{i}-{id(engine)}", text=text, mode=mode,
                                  sampling=SamplingParams(temperature=0.0, repetition_penalty=1.0),
                                  lengths=LengthControls(llm_tokens=9 if mode == "chat" else None,
                                                         audio_frames=30))
                    for i, (text, mode) in enumerate(zip(TEXTS, ["chat", "read", "chat", "read"]))]
        texts = asyncio.run(spoken_texts(engine, requests))
        return texts, [list(engine.trace(r.request_id).finished_segments) for r in requests]

    (padded_texts, padded_codes), (texts, codes) = run(engines[False]), run(engines[True])
    assert texts == padded_texts and texts[0] and texts[2]
    assert codes == padded_codes and all(codes)
    assert engines[True].device_work().get("llm_prefill_packed", 0) >= 1
    assert engines[False].device_work().get("llm_prefill_packed", 0) == 0


async def spoken_texts(engine: MiniCPMOEngine, requests: list[SpeechRequest]) -> list[str]:
    streams = engine.submit(requests)

    async def text(stream) -> str:
        return "".join([chunk.text async for chunk in stream])

    return list(await asyncio.gather(*(text(s) for s in streams)))


def test_the_drift_benchmark_runs_on_the_tiny_checkpoint(tiny_checkpoint):
    """bench/accuracy/packed_prefill.py on the tiny checkpoint (float32): both arms against the
    padded pass, over admissions of several prompts, what each kept (logits, speakers, keys and
    values) copied before the next arm rewrites the slots; in float32 both agree on every first
    token."""
    from bench.accuracy.packed_prefill import measure

    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    result = measure(model, count=6, group=4, longest=40, seed=1)
    computed = result["tokens_computed"]
    assert computed["packed"] < computed["padded_to_longest"]
    for arm in ("packed", "floor"):
        figures = result[arm]
        assert figures["top1_agreement"] == 1.0
        assert 0.0 < figures["speaker_cosine_min"] <= 1.0 + 1e-6
        assert figures["keys_relative_error"]["max"] < 1e-4
        assert figures["kl_nats_temperature_1"]["max"] < 1e-4
