"""The embedded Piper engine: what it does beyond the shared contract (test_engine_contract.py),
and against piper's own synthesis."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from piper.config import SynthesisConfig

from serve_app.engines.base import InvalidRequestError, SpeechRequest
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


def test_speed_changes_duration(engine: PiperEngine) -> None:
    [normal, fast] = asyncio.run(_collect(engine, [_request("n", seed=0),
                                                   _request("f", seed=0, speed=2.0)]))
    assert len(_audio(fast)) < 0.7 * len(_audio(normal))


def test_long_sentence_is_cut_into_several_chunks(engine: PiperEngine) -> None:
    words = " ".join(["word"] * 200)
    [chunks] = asyncio.run(_collect(engine, [_request("long", words, seed=0)]))
    assert len(chunks) >= 2


# Piper's own limits; what every engine refuses is in test_engine_contract.py.
@pytest.mark.parametrize(("fields", "param", "status"), [
    ({"mode": "chat"}, "mode", 422),
    ({"speed": 4.5}, "speed", 400),
    ({"text": "..."}, "text", 400),  # passes the shared text rule; espeak-ng has nothing to say
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
    engine = PiperEngine.from_options(first_piece_phonemes=40, admission="slots")
    text = ("This opening sentence, which is long on purpose, keeps going for quite a while "
            "before it ends.")
    pieces = engine._phonemizer.phonemize(text)
    engine.close()
    assert len(pieces) >= 2
    # BOS/EOS and the pads between phonemes roughly double the id count.
    assert len(pieces[0]) <= 2 * 40 + 2


def test_a_paced_stream_lives_as_long_as_its_audio_plays() -> None:
    """With ``paced_lead_s`` each chunk comes no sooner than that lead before the audio already
    sent would have played out (the fleet runs' stand-in for a GPU engine at load), and the
    stream holds its slot meanwhile; the audio is the same as unpaced."""
    lead_s = 0.3
    text = ("One sentence to begin with. A second one follows it. Then a third sentence comes. "
            "And a fourth one ends the text.")
    paced = PiperEngine.from_options(paced_lead_s=lead_s, max_batch_size=4,
                                     admission="slots")
    plain = PiperEngine.from_options(max_batch_size=4, admission="slots")

    async def timed(engine: PiperEngine) -> tuple[list[float], list, list[int]]:
        times, chunks, active = [], [], []
        [stream] = engine.submit([_request("paced", text=text, seed=3)])
        async for chunk in stream:
            times.append(time.monotonic())
            chunks.append(chunk)
            active.append(engine.stats().active_streams)
        return times, chunks, active

    try:
        times, chunks, active = asyncio.run(timed(paced))
        _, plain_chunks, _ = asyncio.run(timed(plain))
    finally:
        paced.close()
        plain.close()
    with_audio = [(t, c) for t, c in zip(times, chunks) if len(c.samples)]
    assert len(with_audio) >= 4
    first_s = with_audio[0][0]
    sent_s = 0.0
    for at, chunk in with_audio:
        # the chunk left the engine once the audio before it was within lead_s of its end
        assert at >= first_s + sent_s - lead_s, (at - first_s, sent_s)
        sent_s += chunk.duration_s
    assert all(count == 1 for count in active[:-1])  # held in its slot until its last chunk
    np.testing.assert_array_equal(_audio(chunks), _audio(plain_chunks))


def test_a_new_streams_first_piece_goes_before_the_held_streams_turns() -> None:
    """One row a step and four long streams held: a stream submitted now gets its first piece
    at the next step (after the step already running, and a chunk its reader had not taken
    yet), not after every held stream's turn (four more)."""
    text = " ".join(f"Sentence number {n} of a long text keeps this stream busy." for n in range(12))
    engine = PiperEngine.from_options(max_batch_size=1, admission="slots")

    async def run() -> list[str]:
        order: list[str] = []

        async def drain(name: str, stream) -> None:
            async for chunk in stream:
                if len(chunk.samples):
                    order.append(name)

        held = [asyncio.create_task(drain(name, stream)) for name, stream in zip(
            "abcd", engine.submit([_request(f"held-{n}", text=text, seed=1) for n in "abcd"]))]
        while set(order) != set("abcd"):  # every held stream has spoken
            await asyncio.sleep(0.01)
        submitted_at = len(order)
        [new] = engine.submit([_request("new", text=text, seed=1)])
        await drain("new", new)
        await asyncio.gather(*held)
        return order[submitted_at:]

    try:
        after = asyncio.run(run())
    finally:
        engine.close()
    assert after.index("new") <= 2, after[:8]
