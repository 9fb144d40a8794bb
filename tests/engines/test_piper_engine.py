"""The embedded Piper engine against the contract, and against piper's own synthesis."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from piper.config import SynthesisConfig

from serve_app.engines.base import (
    InvalidRequestError,
    RequestAbortedError,
    SpeechRequest,
    refuse_unsupported,
)
from serve_app.engines.piper.piper_engine import PiperEngine
from serve_app.engines.registry import create_engine

TWO_SENTENCES = "Hello from the serving stack. This second sentence is a little longer."


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    engine = create_engine("piper", {"intra_op_threads": 2, "max_batch_size": 4})
    assert isinstance(engine, PiperEngine)
    engine.warmup()
    yield engine
    engine.close()


def _request(request_id: str, text: str = TWO_SENTENCES, **fields) -> SpeechRequest:
    return SpeechRequest(request_id=request_id, text=text, **fields)


async def _collect(engine: PiperEngine, requests: list[SpeechRequest]) -> list[list]:
    async def drain(iterator):
        return [chunk async for chunk in iterator]

    return list(await asyncio.gather(*(drain(it) for it in engine.submit(requests))))


def _audio(chunks) -> np.ndarray:
    return np.concatenate([chunk.samples for chunk in chunks])


def test_streams_one_chunk_per_sentence_and_ends_with_final(engine: PiperEngine) -> None:
    [chunks] = asyncio.run(_collect(engine, [_request("a", seed=1)]))
    assert len(chunks) == 2
    assert [chunk.final for chunk in chunks] == [False, True]
    assert all(chunk.sample_rate_hz == engine.sample_rate_hz == 22050 for chunk in chunks)
    assert all(chunk.samples.dtype == np.float32 and len(chunk.samples) for chunk in chunks)


def test_seeded_request_is_exactly_piper_own_noise_free_synthesis(engine: PiperEngine) -> None:
    [chunks] = asyncio.run(_collect(engine, [_request("b", seed=3)]))
    reference = np.concatenate([
        piece.audio_float_array for piece in engine._voice.synthesize(
            TWO_SENTENCES, SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0))])
    np.testing.assert_array_equal(_audio(chunks), reference)


def test_batched_rows_match_single_runs(engine: PiperEngine) -> None:
    texts = [TWO_SENTENCES, "Short one.", "A medium sized sentence for the batch."]
    batched = asyncio.run(_collect(engine, [_request(f"m{i}", t, seed=0)
                                            for i, t in enumerate(texts)]))
    assert engine.stats().max_batch_size_seen >= 3
    for index, text in enumerate(texts):
        [alone] = asyncio.run(_collect(engine, [_request(f"s{index}", text, seed=0)]))
        assert len(_audio(alone)) == len(_audio(batched[index]))
        np.testing.assert_allclose(_audio(batched[index]), _audio(alone), atol=1e-3)


def test_request_arriving_mid_flight_joins_the_running_batch(engine: PiperEngine) -> None:
    async def scenario() -> None:
        long_text = " ".join(f"This is sentence number {n}." for n in range(6))
        [first] = engine.submit([_request("early", long_text, seed=0)])
        chunk = await first.__anext__()
        assert not chunk.final
        seen_before = engine.stats().steps
        [late] = engine.submit([_request("late", "I joined late.", seed=0)])
        late_chunks = [c async for c in late]
        rest = [c async for c in first]
        assert late_chunks[-1].final and rest[-1].final
        assert engine.stats().steps > seen_before
        assert engine.stats().max_batch_size_seen >= 2

    asyncio.run(scenario())


def test_abort_ends_the_stream_and_frees_the_slot(engine: PiperEngine) -> None:
    async def scenario() -> None:
        aborted_before = engine.stats().aborted
        long_text = " ".join(f"Sentence {n} of a long text." for n in range(8))
        [iterator] = engine.submit([_request("gone", long_text)])
        await iterator.__anext__()
        engine.abort("gone")
        with pytest.raises(RequestAbortedError):
            async for _ in iterator:
                pass
        assert engine.stats().aborted == aborted_before + 1
        assert engine.stats().active_streams == 0

    asyncio.run(scenario())


def test_speed_changes_duration(engine: PiperEngine) -> None:
    [normal, fast] = asyncio.run(_collect(engine, [_request("n", seed=0),
                                                   _request("f", seed=0, speed=2.0)]))
    assert len(_audio(fast)) < 0.7 * len(_audio(normal))


def test_long_sentence_is_cut_into_several_chunks(engine: PiperEngine) -> None:
    words = " ".join(["word"] * 200)
    [chunks] = asyncio.run(_collect(engine, [_request("long", words, seed=0)]))
    assert len(chunks) >= 2


@pytest.mark.parametrize(("fields", "param", "status"), [
    ({"mode": "chat"}, "mode", 422),
    ({"text": "   "}, "text", 400),
    ({"text": "x" * 4097}, "text", 400),
    ({"voice": "nobody"}, "voice", 400),
    ({"speed": 0.1}, "speed", 400),
    ({"speed": 4.5}, "speed", 400),
])
def test_validate_rejects_before_scheduling(engine: PiperEngine, fields: dict, param: str,
                                            status: int) -> None:
    steps = engine.stats().steps
    request = SpeechRequest(**{"request_id": "bad", "text": "Hello.", **fields})
    with pytest.raises(InvalidRequestError) as caught:
        engine.validate(request)
    assert (caught.value.param, caught.value.status_code) == (param, status)
    delivered: list = []
    with pytest.raises(InvalidRequestError):
        engine.submit_to([request], delivered.extend)
    assert engine.stats().steps == steps and not delivered


def test_instructions_are_refused_as_the_engine_cannot_follow_them(engine: PiperEngine) -> None:
    with pytest.raises(InvalidRequestError, match="cannot follow instructions") as caught:
        refuse_unsupported(engine, _request("i", system_prompt="Speak like a pirate."))
    assert (caught.value.param, caught.value.code) == ("instructions", "unsupported_parameter")
    refuse_unsupported(engine, _request("j", system_prompt=""))  # none given: nothing to refuse


def test_chat_error_says_the_engine_cannot_chat(engine: PiperEngine) -> None:
    with pytest.raises(InvalidRequestError, match="cannot chat"):
        engine.validate(_request("c", mode="chat"))


def test_voice_cloning_is_refused_naming_the_engine(engine: PiperEngine) -> None:
    assert engine.clones_voices is False
    clip = np.sin(np.linspace(0, 2000, 32_000)).astype(np.float32)
    for call in (lambda: engine.embed_voice(clip, 16_000),
                 lambda: engine.add_voice("mine", np.zeros((25, 8), np.float32)),
                 lambda: engine.remove_voice("mine")):
        with pytest.raises(InvalidRequestError) as refused:
            call()
        assert refused.value.code == "voice_cloning_unsupported"
        assert refused.value.status_code == 400
        assert "piper" in refused.value.message and "cannot clone voices" in refused.value.message
    assert engine.voices() == ["joe"]


def test_unseeded_requests_still_speak(engine: PiperEngine) -> None:
    [chunks] = asyncio.run(_collect(engine, [_request("noisy")]))
    audio = _audio(chunks)
    assert len(audio) > engine.sample_rate_hz and np.sqrt(np.mean(audio ** 2)) > 0.05


def test_first_piece_is_held_short_for_a_fast_first_chunk() -> None:
    engine = PiperEngine.from_options(first_piece_phonemes=40)
    text = ("This opening sentence, which is long on purpose, keeps going for quite a while "
            "before it ends.")
    pieces = engine._phonemize(text)
    engine.close()
    assert len(pieces) >= 2
    # BOS/EOS and the pads between phonemes roughly double the id count.
    assert len(pieces[0]) <= 2 * 40 + 2
