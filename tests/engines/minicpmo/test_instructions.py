"""Instructions (OpenAI's voice and style direction) shape MiniCPM-o's voice through the prompt."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from serve_app.engines.base import AudioChunk, SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.layers import SlotKVCache, StepInputs, causal_attend
from serve_app.engines.minicpmo.model.loader import load_speech_model

TEXT = "Hello there, this is read aloud."
INSTRUCTIONS = "Speak slowly, in a warm and cheerful voice."


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                            admission="slots", max_slots=4,
                            max_chat_slots=2, tts_max_positions=1024, llm_max_positions=256,
                            tts_sampling="greedy", max_segment_frames=100)
    engine = MiniCPMOEngine(model, options)
    yield engine
    engine.close()


def speaker_embedding(engine: MiniCPMOEngine, request: SpeechRequest) -> torch.Tensor:
    """The speaker embedding of the engine's prompt for ``request`` (one uncached prefill)."""
    ids = (engine.model.tokenizer(engine.plan(request).prompt, add_special_tokens=False)["input_ids"]
           + engine._gen_prompt_ids)
    cache = SlotKVCache(engine.model.config.llm, 1, len(ids), torch.device("cpu"), torch.float32)
    positions = torch.arange(len(ids))[None]
    valid = torch.ones_like(positions, dtype=torch.bool)
    step = StepInputs(torch.tensor([0]), positions, positions,
                      causal_attend(positions, valid, len(ids) + 1))
    with torch.inference_mode():
        hidden = engine.model.llm.hidden_states(torch.tensor([ids]), cache, step)
        return engine.model.tts.speaker_embedding(hidden[0, ids.index(engine._spk_id)][None])[0]


def speak(engine: MiniCPMOEngine, request: SpeechRequest) -> np.ndarray:
    async def run() -> np.ndarray:
        (stream,) = engine.submit([request])
        return np.concatenate([chunk.samples async for chunk in stream])

    return asyncio.run(run())


def test_instructions_come_first_as_upstream_places_a_system_prompt(engine):
    prompt = engine.plan(SpeechRequest("p", TEXT, system_prompt=INSTRUCTIONS)).prompt
    assert prompt == (f"<|im_start|>user\n{INSTRUCTIONS}<|im_end|>\n"
                      f"<|im_start|>user\nPlease read the text below.\n{TEXT}<|im_end|>\n")
    assert engine.plan(SpeechRequest("q", TEXT)).prompt == (
        f"<|im_start|>user\nPlease read the text below.\n{TEXT}<|im_end|>\n")


def test_instructions_change_the_speaker_embedding_and_the_audio(engine):
    plain = SpeechRequest("plain", TEXT)
    directed = SpeechRequest("directed", TEXT, system_prompt=INSTRUCTIONS)
    engine.validate(directed)
    plain_speaker = speaker_embedding(engine, plain)
    directed_speaker = speaker_embedding(engine, directed)
    assert plain_speaker.shape == directed_speaker.shape
    assert not torch.allclose(plain_speaker, directed_speaker, atol=1e-4)
    # Greedy decoding: the same text spoken twice is identical unless the speaker differs.
    assert np.array_equal(speak(engine, plain), speak(engine, SpeechRequest("plain-2", TEXT)))
    assert not np.array_equal(speak(engine, plain), speak(engine, directed))


def final_chunks(engine: MiniCPMOEngine, *requests: SpeechRequest) -> list[AudioChunk]:
    async def run() -> list[AudioChunk]:
        return [[chunk async for chunk in stream][-1] for stream in engine.submit(list(requests))]

    return asyncio.run(run())


def test_usage_on_the_final_chunk_counts_the_instructions_tokens(engine):
    streamed = SpeechRequest("c", "", text_input="streamed", system_prompt=INSTRUCTIONS)

    async def feed_and_read() -> AudioChunk:
        (stream,) = engine.submit([streamed])
        engine.feed_text("c", TEXT[:11])
        engine.feed_text("c", TEXT[11:], done=True)
        return [chunk async for chunk in stream][-1]

    plain, directed = final_chunks(engine, SpeechRequest("a", TEXT),
                                   SpeechRequest("b", TEXT, system_prompt=INSTRUCTIONS))
    fed = asyncio.run(feed_and_read())
    assert plain.final and plain.usage.input_tokens == engine.count_tokens(TEXT) > 0
    assert directed.usage.input_tokens == plain.usage.input_tokens + engine.count_tokens(INSTRUCTIONS)
    # Streamed text counts as it is tokenized: the same tokens as the whole text.
    assert fed.usage.input_tokens == directed.usage.input_tokens
    # Output: the audio code frames generated, one per token.
    assert plain.usage.output_tokens == plain.timings_s["tts_steps"] > 0
