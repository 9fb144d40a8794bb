"""Voice cloning reproduces upstream MiniCPM-o 2.6 (tests/golden_voice): the reference clip's
features, encoder outputs in both attention forms, projection and pooled embeddings; the
voice-cloning prompt and the speaker state at ``<|spk|>``, with the voice turn's keys and values
cached and without; and the speech stream in that voice (codes exactly, audio within 1e-4)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from serve_app.engines.base import SpeechRequest
from serve_app.engines.minicpmo.model.audio_in import chunk_attention
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine, StreamPlan
from serve_app.engines.minicpmo.model.loader import load_speech_model
from serve_app.engines.minicpmo.voices import VoiceTurn, placeholder_chunks
from tests.engines.minicpmo.test_golden_parity import (
    collect,
    expected_codes_by_call,
    golden_codes_by_call,
)
from tests.golden_voice.checkpoint import load_expected, load_manifest

FLOATS = dict(rtol=1e-4, atol=1e-5)
READ_TURN = "<|im_start|>user\nPlease read the text below.\n"  # + text; the generation prompt ends it


@pytest.fixture(scope="module")
def engine(voice_checkpoint):
    model = load_speech_model(str(voice_checkpoint), device="cpu", dtype=torch.float32,
                              audio_encoder=True)
    options = EngineOptions(model=str(voice_checkpoint), device="cpu", dtype="float32",
                            admission="slots",  # as tiny_engine.py: a busy CPU refuses by work
                            max_slots=4, max_chat_slots=2, tts_max_positions=1024,
                            llm_max_positions=512, tts_sampling="greedy", keep_traces=True)
    engine = MiniCPMOEngine(model, options)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def features():
    return load_expected("voice_features")


def read_text() -> str:
    return "".join(load_manifest()["cases"]["voice_stream"]["text_pieces"])


def own_turn_ids(engine: MiniCPMOEngine) -> list[int]:
    """The request's own part of upstream's voice-cloning prompt (after the voice turn)."""
    tok = engine.model.tokenizer
    return tok(READ_TURN + read_text(), add_special_tokens=False)["input_ids"] + engine._gen_prompt_ids


def test_features_encoder_projection_and_pooling_match_upstream(engine, features):
    encoder = engine.model.clip_encoder
    with torch.inference_mode():
        mel = encoder.features(features["waveform"])
        np.testing.assert_allclose(mel.numpy(), features["input_features"], **FLOATS)
        assert mel.shape[-1] == int(features["feature_lens"][0])
        for form, chunked in (("chunked", True), ("full", False)):
            encoded = encoder.encode(mel, chunked=chunked)
            np.testing.assert_allclose(encoded.encoder_hidden.numpy(),
                                       features[f"apm_hidden_{form}"], **FLOATS)
            np.testing.assert_allclose(encoded.projected.numpy(), features[f"projected_{form}"],
                                       **FLOATS)
            np.testing.assert_allclose(encoded.embeddings.numpy(), features[f"audio_embeds_{form}"],
                                       **FLOATS)
    frames = features["chunk_mask"].shape[0]
    assert np.array_equal(chunk_attention(frames, encoder.config.chunk_frames).numpy(),
                          features["chunk_mask"])
    # the two forms really differ, so each comparison above checks its own form
    assert not np.allclose(features["audio_embeds_chunked"], features["audio_embeds_full"], **FLOATS)


def test_embed_voice_gives_the_chunked_embeddings_and_placeholders(engine, features):
    embeddings = engine.embed_voice(features["waveform"], 16_000)
    assert embeddings.dtype == np.float32
    np.testing.assert_allclose(embeddings, features["audio_embeds_chunked"], **FLOATS)
    per_chunk = engine.model.config.audio.tokens_per_chunk
    assert placeholder_chunks(len(embeddings), per_chunk) == features["unk_per_chunk"].tolist()
    placeholder = load_manifest()["cases"]["voice_features"]["placeholder"]
    tok = engine.model.tokenizer
    turn = engine.voice_turn(len(embeddings))
    placeholder_ids = tok(placeholder, add_special_tokens=False)["input_ids"]
    assert placeholder_ids == features["placeholder_ids"].tolist()
    start = turn.audio_positions[0] - 1
    assert turn.token_ids[start:start + len(placeholder_ids)] == placeholder_ids


def test_voice_prompt_and_speaker_state_match_upstream_with_and_without_the_cached_turn(
        engine, features):
    expected = load_expected("voice_prompt")
    embeddings = engine.embed_voice(features["waveform"], 16_000)
    turn = engine.voice_turn(len(embeddings))
    ids = turn.token_ids + own_turn_ids(engine)
    assert ids == expected["input_ids"].tolist()
    bounds = [[start, end] for start, end in expected["audio_bounds"]]
    spans = [p for start, end in bounds for p in range(start, end)]
    assert turn.audio_positions == spans
    spk = ids.index(engine._spk_id)
    assert [spk, spk + 1] == expected["spk_bounds"][0].tolist()
    audio = torch.from_numpy(embeddings)
    runner = engine._runner
    with torch.inference_mode():
        np.testing.assert_allclose(runner.prompt_embeddings(ids, turn.audio_positions, audio).numpy(),
                                   expected["inputs_embeds"], **FLOATS)
        # without the cache: one prefill of the whole prompt
        hidden, _ = runner.prefill_with_audio(ids, turn.audio_positions, audio)
        np.testing.assert_allclose(hidden[spk].numpy(), expected["spk_hidden"][0], **FLOATS)
    # with it: the voice turn's keys and values from add_voice, then the request's own turn as
    # the admission prefill runs it (next to a default-voice row, so the batch has two prefixes)
    engine.add_voice("golden", embeddings)
    (voice,) = engine._voices.acquire(["golden"])
    try:
        own = own_turn_ids(engine)
        other = engine.model.tokenizer("<|im_start|>user\nHi.<|im_end|>\n",
                                       add_special_tokens=False)["input_ids"] + engine._gen_prompt_ids
        ids_t = torch.zeros(2, len(own), dtype=torch.long)
        valid = torch.zeros(2, len(own), dtype=torch.bool)
        for row, prompt in enumerate((own, other)):
            ids_t[row, :len(prompt)] = torch.tensor(prompt)
            valid[row, :len(prompt)] = True
        with torch.inference_mode():
            hidden, _ = runner.llm_prefill(ids_t, valid, [voice, None])
        np.testing.assert_allclose(hidden[0, own.index(engine._spk_id)].numpy(),
                                   expected["spk_hidden"][0], **FLOATS)
    finally:
        engine._voices.release([voice])


def test_streaming_api_voice_prompt_matches_upstream_through_the_prefix_cache(engine, features):
    """Upstream's streaming API prefills the voice turn (its own form: full-attention audio, no
    newline before the audio), keeps its KV cache and prefills the user turn after it. The
    engine's voices use ``chat``'s form, but the same prefix machinery reproduces this one."""
    expected = load_expected("voice_prompt_streaming")
    spans = [p for start, end in expected["sys_audio_bounds"] for p in range(start, end)]
    turn = VoiceTurn(expected["sys_ids"].tolist(), spans)
    own = expected["user_ids"].tolist() + expected["gen_ids"].tolist()
    assert expected["gen_ids"].tolist() == engine._gen_prompt_ids
    with torch.inference_mode():
        voice = engine._runner.voice_prefix("streaming-form", turn,
                                            torch.from_numpy(features["audio_embeds_full"]))
        hidden, _ = engine._runner.llm_prefill(torch.tensor([own]),
                                               torch.ones(1, len(own), dtype=torch.bool), [voice])
    np.testing.assert_allclose(hidden[0, own.index(engine._spk_id)].numpy(),
                               expected["spk_hidden"][0], **FLOATS)


def test_speech_in_the_cloned_voice_matches_upstream(engine, features):
    expected = load_expected("voice_stream")
    engine.add_voice("golden-stream", engine.embed_voice(features["waveform"], 16_000))
    pieces = load_manifest()["cases"]["voice_stream"]["text_pieces"]
    request = SpeechRequest(request_id="golden-voice-stream", text=read_text(), voice="golden-stream")

    async def run():
        (stream,) = engine.submit_plans([StreamPlan(request, READ_TURN + read_text(), list(pieces))])
        return await collect(stream)

    wav = asyncio.run(run())
    got = golden_codes_by_call(engine.trace("golden-voice-stream"))
    want = expected_codes_by_call(expected)
    assert [len(c) for c in got] == [len(c) for c in want]
    for index, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"codes differ after call {index}"
    assert wav.shape == expected["wav"].shape
    np.testing.assert_allclose(wav, expected["wav"], **FLOATS)
