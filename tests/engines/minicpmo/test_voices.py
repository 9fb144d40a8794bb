"""Cloned voices on the real engine (tiny voice checkpoint, CPU): the API's contract, refusals
that touch nothing, clips at any common rate, read and chat streams in cloned voices batched
with the default voice (greedy codes as alone, while another thread adds a voice), and the
bounded, least-recently-used voice table that never drops a voice a stream holds."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import soxr
import torch

from serve_app.engines.base import (
    EngineOverloadedError,
    InvalidRequestError,
    LengthControls,
    SamplingParams,
    SpeechRequest,
)
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.loader import load_speech_model
from serve_app.engines.minicpmo.model.synthetic import synthetic_voice_clip
from serve_app.engines.minicpmo.text import PIECE_TOKENS, TTS_EOS_MARK, PieceDecoder
from tests.engines.streams import drain

ANSWER_TOKENS = 9
READ_LENGTHS = LengthControls(ignore_eos=True, audio_frames=50)


def make_engine(checkpoint, **options) -> MiniCPMOEngine:
    model = load_speech_model(str(checkpoint), device="cpu", dtype=torch.float32,
                              audio_encoder=True)
    # admission by slots, as the suite's other engines (tiny_engine.py): by work, a CPU busy with
    # other work measured slow steps and refused streams this test needs (a fresh-clone run)
    settings = dict(model=str(checkpoint), device="cpu", dtype="float32", admission="slots",
                    max_slots=6, max_chat_slots=2, tts_max_positions=1024, llm_max_positions=512,
                    tts_sampling="greedy", keep_traces=True)
    return MiniCPMOEngine(model, EngineOptions(**{**settings, **options}))


@pytest.fixture(scope="module")
def engine(voice_checkpoint):
    engine = make_engine(voice_checkpoint, max_voices=4)
    yield engine
    engine.close()


def read(request_id: str, voice: str = "default", text: str = "Hello there, my friend.",
         **fields) -> SpeechRequest:
    return SpeechRequest(request_id=request_id, text=text, voice=voice, lengths=READ_LENGTHS,
                         **fields)


def chat(request_id: str, voice: str) -> SpeechRequest:
    return SpeechRequest(request_id=request_id, text="Tell me about rivers.", mode="chat",
                         voice=voice, sampling=SamplingParams(temperature=0.0, repetition_penalty=1.0),
                         lengths=LengthControls(llm_tokens=ANSWER_TOKENS, audio_frames=30))


def codes(engine: MiniCPMOEngine, request_id: str) -> np.ndarray:
    return np.asarray([f for segment in engine.trace(request_id).finished_segments for f in segment])


async def speak(engine: MiniCPMOEngine, requests: list[SpeechRequest], stagger_s: float = 0.0):
    """Each request's audio and the text its chunks covered (the i-th after ``i * stagger_s``)."""
    async def one(request: SpeechRequest, delay_s: float):
        await asyncio.sleep(delay_s)
        (stream,) = engine.submit([request])
        chunks = [chunk async for chunk in stream]
        return np.concatenate([c.samples for c in chunks]), "".join(c.text for c in chunks)

    return await asyncio.gather(*(one(r, i * stagger_s) for i, r in enumerate(requests)))


def reference_chat_answer(engine: MiniCPMOEngine, request: SpeechRequest,
                          embeddings: np.ndarray) -> str:
    """Greedy decoding over the voice turn + the prompt, the whole sequence recomputed for
    every token (no cached voice turn, no LLM slot)."""
    tok = engine.model.tokenizer
    turn = engine.voice_turn(len(embeddings))
    ids = (turn.token_ids + tok(engine.plan(request).prompt, add_special_tokens=False)["input_ids"]
           + engine._gen_prompt_ids)
    answer: list[int] = []
    with torch.inference_mode():
        for _ in range(ANSWER_TOKENS):
            hidden, _ = engine._runner.prefill_with_audio(ids + answer, turn.audio_positions,
                                                          torch.from_numpy(embeddings))
            answer.append(int(engine.model.llm.logits(hidden[-1:]).argmax()))
    decoder = PieceDecoder(tok.decode, engine._terminators)
    pieces = [decoder.push(answer[i:i + PIECE_TOKENS]) for i in range(0, len(answer), PIECE_TOKENS)]
    return "".join(piece.split(TTS_EOS_MARK)[0] for piece in pieces)


def test_added_voices_are_listed_usable_and_removed(engine):
    engine.add_voice("amy", engine.embed_voice(synthetic_voice_clip(1, 2.0), 16_000))
    assert engine.clones_voices and engine.voices() == ["default", "amy"]
    engine.validate(read("in-amy", voice="amy"))
    engine.remove_voice("amy")
    engine.remove_voice("amy")  # not loaded: nothing to do
    assert engine.voices() == ["default"]
    with pytest.raises(InvalidRequestError) as refused:
        engine.validate(read("in-amy", voice="amy"))
    assert (refused.value.param, refused.value.code) == ("voice", "voice_not_found")


def clip_case(seconds: float = 2.0, rate: int = 16_000) -> np.ndarray:
    return synthetic_voice_clip(7, seconds, rate)


def with_nan() -> np.ndarray:
    samples = clip_case()
    samples[100] = np.nan
    return samples


@pytest.mark.parametrize("samples, rate, code", [
    (np.zeros(0, np.float32), 16_000, "audio_empty"),
    (with_nan(), 16_000, "audio_not_finite"),
    (np.full(32_000, np.inf, np.float32), 16_000, "audio_not_finite"),
    (np.zeros(32_000, np.float32), 16_000, "audio_silent"),
    (clip_case() * 1e-4, 16_000, "audio_silent"),
    (clip_case(0.6), 16_000, "audio_too_short"),
    (clip_case(30.5, 8_000), 8_000, "audio_too_long"),
    (np.stack([clip_case(), clip_case()]), 16_000, "audio_not_mono"),
    (np.array(["a"] * 32_000), 16_000, "invalid_audio"),
    (None, 16_000, "invalid_audio"),
    (np.ones(32_000, bool), 16_000, "invalid_audio"),
    (clip_case(), 4_000, "unsupported_sample_rate"),
    (clip_case(), 16_000.5, "unsupported_sample_rate"),
    (clip_case(), True, "unsupported_sample_rate"),
], ids=["empty", "nan", "inf", "zeros", "quiet", "short", "long", "stereo", "text", "none", "bool",
        "rate-low", "rate-float", "rate-bool"])
def test_a_clip_that_cannot_be_a_voice_is_refused_and_touches_nothing(engine, samples, rate, code):
    before = (engine.voices(), engine.stats())
    with pytest.raises(InvalidRequestError) as refused:
        engine.embed_voice(samples, rate)
    assert (refused.value.param, refused.value.code) == ("audio_sample", code)
    assert (engine.voices(), engine.stats()) == before


@pytest.mark.parametrize("voice_id, embeddings, param, code", [
    ("default", None, "voice_id", "reserved_voice_id"),
    ("", None, "voice_id", "invalid_voice_id"),
    ("has space", None, "voice_id", "invalid_voice_id"),
    ("x" * 129, None, "voice_id", "invalid_voice_id"),
    (7, None, "voice_id", "invalid_voice_id"),
    ("ok", np.zeros((10, 31), np.float32), "embeddings", "invalid_embeddings"),
    ("ok", np.zeros(32, np.float32), "embeddings", "invalid_embeddings"),
    ("ok", np.zeros((0, 32), np.float32), "embeddings", "invalid_embeddings"),
    ("ok", np.zeros((751, 32), np.float32), "embeddings", "invalid_embeddings"),
    ("ok", np.zeros((10, 32), np.int64), "embeddings", "invalid_embeddings"),
    ("ok", np.full((10, 32), np.nan, np.float32), "embeddings", "invalid_embeddings"),
    ("ok", [[0.0] * 32] * 10, "embeddings", "invalid_embeddings"),
], ids=["default", "empty-id", "space", "long-id", "int-id", "width", "1d", "no-tokens",
        "past-30s", "ints", "nan", "list"])
def test_bad_voice_ids_and_embeddings_are_refused(engine, voice_id, embeddings, param, code):
    if embeddings is None:
        embeddings = np.zeros((10, 32), np.float32)
    before = engine.voices()
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_voice(voice_id, embeddings)
    assert (refused.value.param, refused.value.code) == (param, code)
    assert engine.voices() == before


@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100, 48_000])
def test_a_clip_at_any_common_rate_is_resampled_to_16_khz(engine, rate):
    at_16k = synthetic_voice_clip(3, 2.5, 16_000)
    reference = engine.embed_voice(at_16k, 16_000)
    embeddings = engine.embed_voice(soxr.resample(at_16k, 16_000, rate), rate)
    assert embeddings.shape == reference.shape  # 40 ms per embedding, whatever the rate
    if rate > 16_000:  # nothing lost: the same voice up to resampling error
        np.testing.assert_allclose(embeddings, reference, rtol=0, atol=0.02)  # voices differ by ~0.1


def test_integer_pcm_and_a_one_column_clip_are_read_as_mono_samples(engine):
    clip = synthetic_voice_clip(5, 1.5)
    pcm = np.round(clip * 32767).astype(np.int16)
    want = engine.embed_voice(pcm.astype(np.float32) / 32768, 16_000)
    np.testing.assert_allclose(engine.embed_voice(pcm, 16_000), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(engine.embed_voice(clip[:, None], 16_000),
                               engine.embed_voice(clip, 16_000), rtol=1e-5, atol=1e-6)


def test_read_and_chat_in_cloned_voices_batch_with_the_default_voice(engine):
    """Greedy TTS: each stream's codes alone equal its codes in a mixed batch of voices, modes
    and arrivals, while another thread embeds and adds a voice; the chat answer in a cloned
    voice is the greedy continuation of the voice turn and the prompt."""
    clips = {"ann": synthetic_voice_clip(11, 2.0), "bob": synthetic_voice_clip(12, 3.0, 24_000)}
    embeddings = {"ann": engine.embed_voice(clips["ann"], 16_000),
                  "bob": engine.embed_voice(clips["bob"], 24_000)}
    for voice_id, values in embeddings.items():
        engine.add_voice(voice_id, values)
    requests = {"ann": read("alone-ann", "ann"), "bob": read("alone-bob", "bob"),
                "default": read("alone-default"), "chat-ann": chat("alone-chat-ann", "ann")}
    alone = {key: asyncio.run(speak(engine, [request]))[0] for key, request in requests.items()}
    assert alone["chat-ann"][1] == reference_chat_answer(engine, requests["chat-ann"],
                                                         embeddings["ann"])
    assert not np.array_equal(codes(engine, "alone-ann")[:25], codes(engine, "alone-default")[:25])
    assert not np.array_equal(codes(engine, "alone-ann")[:25], codes(engine, "alone-bob")[:25])

    added = threading.Thread(target=lambda: engine.add_voice(
        "cat", engine.embed_voice(synthetic_voice_clip(13, 2.0), 16_000)))
    batched_requests = [read("mixed-ann", "ann"), read("mixed-default"), chat("mixed-chat-ann", "ann"),
                        read("mixed-bob", "bob")]

    async def mixed():
        task = asyncio.ensure_future(speak(engine, batched_requests, stagger_s=0.05))
        added.start()
        return await task

    batched = dict(zip(["ann", "default", "chat-ann", "bob"], asyncio.run(mixed())))
    added.join()
    assert "cat" in engine.voices()
    for key in requests:
        assert np.array_equal(codes(engine, f"mixed-{key}"), codes(engine, f"alone-{key}")), key
        np.testing.assert_allclose(batched[key][0], alone[key][0], rtol=1e-4, atol=1e-5)
        assert batched[key][1] == alone[key][1]
    assert engine.stats().max_batch_size_seen > 1


def test_the_table_drops_the_least_recently_used_idle_voice_never_one_in_use(voice_checkpoint):
    engine = make_engine(voice_checkpoint, max_voices=2)
    embeddings = engine.embed_voice(synthetic_voice_clip(21, 1.5), 16_000)
    try:
        async def run():
            engine.add_voice("a", embeddings)
            engine.add_voice("b", embeddings)
            # a streamed request stays open (holding its voice) until its text is done
            (held_a,) = engine.submit([read("held-a", "a", text="", text_input="streamed")])
            engine.add_voice("c", embeddings)  # full: b is the least recently used idle voice
            assert engine.voices() == ["default", "a", "c"]
            engine.add_voice("d", embeddings)  # a is older but held: c goes
            assert engine.voices() == ["default", "a", "d"]
            (held_d,) = engine.submit([read("held-d", "d", text="", text_input="streamed")])
            with pytest.raises(EngineOverloadedError):
                engine.add_voice("e", embeddings)  # every loaded voice is held
            engine.remove_voice("a")  # removed while held: its stream still finishes in it
            assert engine.voices() == ["default", "d"]
            for request_id in ("held-a", "held-d"):
                engine.feed_text(request_id, "The end of it.", done=True)
            results = await asyncio.gather(drain(held_a), drain(held_d))
            assert [error for _, error in results] == [None, None]
            assert all(chunks > 0 for chunks, _ in results)
            engine.add_voice("e", embeddings)
            engine.add_voice("f", embeddings)  # d is idle again: it goes
            assert engine.voices() == ["default", "e", "f"]

        asyncio.run(run())
        assert codes(engine, "held-a").shape == codes(engine, "held-d").shape
    finally:
        engine.close()


def test_a_voice_in_a_refused_submission_is_not_held(engine):
    engine.add_voice("dan", engine.embed_voice(synthetic_voice_clip(31, 1.5), 16_000))

    async def run():
        with pytest.raises(InvalidRequestError):
            engine.submit([read("dup", "dan"), read("dup", "dan")])  # duplicate request id

    asyncio.run(run())
    assert all(voice.streams == 0 for voice in engine._voices._voices.values())


def test_voices_off_loads_no_audio_encoder_and_refuses_cloning(voice_checkpoint):
    off = MiniCPMOEngine.from_options(model=str(voice_checkpoint), device="cpu", dtype="float32",
                                      max_slots=1, max_chat_slots=1, voices=False)
    on = MiniCPMOEngine.from_options(model=str(voice_checkpoint), device="cpu", dtype="float32",
                                     max_slots=1, max_chat_slots=1)
    try:
        assert off.model.clip_encoder is None and not off.clones_voices
        assert on.model.clip_encoder is not None and on.clones_voices
        for call in (lambda: off.embed_voice(synthetic_voice_clip(1, 2.0), 16_000),
                     lambda: off.add_voice("x", np.zeros((10, 32), np.float32)),
                     lambda: off.remove_voice("x")):
            with pytest.raises(InvalidRequestError) as refused:
                call()
            assert refused.value.code == "voice_cloning_off"
        with pytest.raises(InvalidRequestError) as refused:
            off.validate(read("x", "x"))
        assert refused.value.code == "voice_not_found"
        assert off.voices() == ["default"]
    finally:
        off.close()
        on.close()


def test_prefill_graph_buffers_give_the_eager_prefill_with_voice_turns(engine):
    """The CUDA-graph admission prefill's bookkeeping (buckets, static buffers, each row's voice
    turn copied in, stale rows from a longer earlier prefill) checked on the CPU: each bucket's
    forward replays eagerly into its static output, as a captured graph would."""
    from serve_app.engines.minicpmo.device.llm_step import LLMPrefillGraphs

    model = engine.model
    graphs = LLMPrefillGraphs(model.llm, model.config.llm, torch.device("cpu"), torch.float32,
                              max_batch=4, lengths=(16, 32), prefix_lengths=(0, 64, 128))

    class EagerReplay:
        def __init__(self, index: int) -> None:
            self.index = index
            self.out = graphs._forward(index)

        def replay(self) -> None:
            self.out.copy_(graphs._forward(self.index))

    with torch.inference_mode():
        for index, key in enumerate(graphs.keys):
            replay = EagerReplay(index)
            graphs.graphs[key] = (replay, replay.out)
        engine.add_voice("short", engine.embed_voice(synthetic_voice_clip(41, 1.2), 16_000))
        engine.add_voice("long", engine.embed_voice(synthetic_voice_clip(42, 3.0), 16_000))
        voices = engine._voices.acquire(["short", "long"])
        try:
            assert [v.length for v in voices] == sorted(v.length for v in voices) and voices[1].length > 64
            tok = model.tokenizer
            prompts = [tok(f"<|im_start|>user\n{text}<|im_end|>\n", add_special_tokens=False)["input_ids"]
                       for text in ("Hi there.", "A somewhat longer question here?", "Ok.")]
            for rows in ([(0, voices[1]), (1, None), (2, voices[0])], [(2, None), (0, voices[0])]):
                chosen = [prompts[i] for i, _ in rows]
                longest = max(len(p) for p in chosen)
                ids = torch.zeros(len(rows), longest, dtype=torch.long)
                valid = torch.zeros(len(rows), longest, dtype=torch.bool)
                for row, prompt in enumerate(chosen):
                    ids[row, :len(prompt)] = torch.tensor(prompt)
                    valid[row, :len(prompt)] = True
                prefixes = [voice for _, voice in rows]
                assert graphs.fits(len(rows), longest, max(v.length for v in prefixes if v))
                want, _ = engine._runner.llm_prefill(ids, valid, prefixes)
                got = graphs.run(ids, valid, prefixes)
                torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
        finally:
            engine._voices.release(voices)


def test_voices_on_with_a_checkpoint_without_an_audio_encoder_serves_without_cloning(
        tiny_checkpoint):
    engine = MiniCPMOEngine.from_options(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                                         max_slots=1, max_chat_slots=1)
    try:
        assert engine.options.voices and not engine.clones_voices
        assert engine.model.clip_encoder is None and engine.voices() == ["default"]
        with pytest.raises(InvalidRequestError) as refused:
            engine.add_voice("x", np.zeros((10, 32), np.float32))
        assert refused.value.code == "voice_cloning_off"
    finally:
        engine.close()
