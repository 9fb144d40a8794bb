"""The engine contract (serve_app/engines/base.py), one suite run over every engine: MiniCPM-o on
the tiny golden checkpoint (CPU, greedy) and Piper with its embedded voice. Real engines only.

What each engine does with the text (golden parity, Piper's own synthesis, the way MiniCPM-o
cuts text at a pause) stays in that engine's own tests; here is what every engine promises (for
streamed text in, test_engine_contract_text_input.py; what the two share, contract.py).

Streams here are deterministic: MiniCPM-o decodes greedily and Piper's seeded requests have no
noise, so the same request gives the same audio, alone or beside others. Random tiny weights
never stop by themselves, so every request carries a fixed length (``FRAMES``, which Piper
ignores) or ``max_audio_s``. Nothing is timed: ``HANG_GUARD_S`` only turns a hang (a stream
that never speaks) into a failure.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from serve_app.engines.base import (
    AudioChunk,
    EngineStats,
    InvalidRequestError,
    LengthControls,
    RequestAbortedError,
    SpeechRequest,
    refuse_unsupported,
)
from tests.engines.contract import (FRAMES, SPEAKABLE_START, TWO_SENTENCES, Sink, assert_quiet,
                                    audio, chunks_of, contract_engines, drain_guarded, first_chunk,
                                    rid, spoken_alone, streamed, whole)
from tests.engines.streams import drain

pytestmark = pytest.mark.timeout(900)  # guards against a hang only; nothing here is timed

engine = contract_engines()


# ---- what the engine says about itself ----------------------------------------------------


def test_engine_info(engine) -> None:
    assert isinstance(engine.sample_rate_hz, int) and engine.sample_rate_hz >= 8_000
    assert isinstance(engine.modes, tuple) and "read" in engine.modes
    assert set(engine.modes) <= {"read", "chat"}
    assert isinstance(engine.clones_voices, bool)
    voices = engine.voices()
    assert voices and all(isinstance(voice, str) and voice for voice in voices)
    for voice in [*voices, "default"]:  # every voice it lists, and "default", may be asked for
        engine.validate(whole("info", voice=voice))
    stats = engine.stats()
    assert isinstance(stats, EngineStats) and stats.max_slots >= 1
    assert all(isinstance(value, (int, float)) for value in stats.as_dict().values())


@pytest.mark.parametrize("mode", ["read", "chat", "sing"])
def test_a_mode_is_served_exactly_when_the_engine_lists_it(engine, mode: str) -> None:
    request = whole(rid("mode"), "Hello, how are you?", mode=mode)
    if mode in engine.modes:
        engine.validate(request)
    else:
        with pytest.raises(InvalidRequestError) as refused:
            engine.validate(request)
        assert refused.value.param == "mode"


def test_instructions_are_refused_unless_the_engine_follows_them(engine) -> None:
    request = whole(rid("instructions"), system_prompt="Speak like a pirate.")
    if getattr(engine, "follows_instructions", False):
        refuse_unsupported(engine, request)
        engine.validate(request)
    else:
        with pytest.raises(InvalidRequestError) as refused:
            refuse_unsupported(engine, request)
        assert (refused.value.param, refused.value.code) == ("instructions",
                                                             "unsupported_parameter")
    refuse_unsupported(engine, whole(rid("no-instructions"), system_prompt=""))


def test_an_engine_that_cannot_clone_voices_refuses_every_voice_call(engine) -> None:
    assert engine.clones_voices is False  # both engines here (the tiny checkpoint has no encoder)
    voices = engine.voices()
    clip = (0.3 * np.sin(np.linspace(0, 2000, 32_000))).astype(np.float32)
    for call in (lambda: engine.embed_voice(clip, 16_000),
                 lambda: engine.add_voice("mine", np.zeros((25, 8), np.float32)),
                 lambda: engine.remove_voice("mine")):
        with pytest.raises(InvalidRequestError) as refused:
            call()
        assert refused.value.status_code == 400
    assert engine.voices() == voices
    with pytest.raises(InvalidRequestError) as refused:
        engine.validate(whole(rid("voice"), voice="mine"))
    assert refused.value.param == "voice"


# ---- a read stream ------------------------------------------------------------------------


def test_a_read_stream_yields_audio_chunks_then_one_final_chunk(engine) -> None:
    request = whole(rid("read"))

    async def run():
        (stream,) = engine.submit([request])
        return await chunks_of(stream)

    chunks = asyncio.run(run())
    assert len(chunks) >= 2  # streamed in pieces, not one block at the end
    assert [chunk.final for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    for chunk in chunks:
        assert chunk.request_id == request.request_id
        assert chunk.sample_rate_hz == engine.sample_rate_hz
        assert chunk.samples.dtype == np.float32 and chunk.samples.ndim == 1
        assert np.isfinite(chunk.samples).all()
    assert len(chunks[0].samples) > 0
    assert len(audio(chunks)) > engine.sample_rate_hz // 2
    assert_quiet(engine)


def test_submit_to_delivers_the_same_stream_to_a_sink_in_order(engine) -> None:
    request = whole(rid("sink"))

    async def run():
        sink = Sink()
        engine.submit_to([request], sink)
        await sink.wait_ended(request.request_id)
        return sink

    sink = asyncio.run(run())
    items = sink.of(request.request_id)
    assert all(isinstance(item, AudioChunk) for item in items)
    assert [item.final for item in items] == [False] * (len(items) - 1) + [True]
    assert {r for r, _ in sink.items} == {request.request_id}
    alone = spoken_alone(engine, whole(rid("sink-iterated")))
    np.testing.assert_allclose(audio(items), alone, atol=1e-4)


def test_max_audio_s_caps_the_stream(engine) -> None:
    # no fixed length: MiniCPM-o's random weights would speak on to its position limit
    request = SpeechRequest(rid("capped"), TWO_SENTENCES, seed=1, max_audio_s=1.0)

    async def run():
        (stream,) = engine.submit([request])
        return await chunks_of(stream)

    chunks = asyncio.run(run())
    assert chunks[-1].final
    assert 0 < len(audio(chunks)) <= engine.sample_rate_hz * 1.0
    uncapped = spoken_alone(engine, whole(rid("uncapped")))
    assert len(uncapped) > engine.sample_rate_hz  # the cap is what cut it


@pytest.mark.parametrize("arrival", ["together", "mid-flight"])
def test_concurrent_streams_do_not_mix(engine, arrival: str) -> None:
    """Each stream of a batch gets its own audio: what it gets alone."""
    texts = [TWO_SENTENCES + " A third sentence, and a fourth one after it. The end.",
             "Short one, but not too short.",
             "A medium sized sentence for the batch, with a comma in it."]
    alone = [spoken_alone(engine, whole(rid("alone"), text)) for text in texts]
    for a, b in itertools.combinations(alone, 2):  # a mix-up would show
        assert len(a) != len(b) or not np.allclose(a, b, atol=1e-2)
    requests = [whole(rid(f"batch{i}"), text) for i, text in enumerate(texts)]

    async def run():
        if arrival == "together":
            streams = engine.submit(requests)
            return await asyncio.gather(*(chunks_of(s) for s in streams))
        (first,) = engine.submit(requests[:1])
        head = await first_chunk(first)  # the first stream is running when the others come
        others = engine.submit(requests[1:])
        results = await asyncio.gather(chunks_of(first), *(chunks_of(s) for s in others))
        return [[head, *results[0]], *results[1:]]

    results = asyncio.run(run())
    for request, chunks, expected in zip(requests, results, alone):
        assert {chunk.request_id for chunk in chunks} == {request.request_id}
        assert chunks[-1].final
        assert len(audio(chunks)) == len(expected)
        np.testing.assert_allclose(audio(chunks), expected, atol=1e-3)
    assert engine.stats().max_batch_size_seen >= 2
    assert_quiet(engine)


# ---- refusals -----------------------------------------------------------------------------

INVALID = {
    "blank-text": ({"text": "   "}, "text"),
    "text-too-long": ({"text": "x" * 4097}, "text"),
    "nul-in-text": ({"text": "Hello\x00world."}, "text"),
    "unknown-voice": ({"voice": "nobody"}, "voice"),
    "unknown-mode": ({"mode": "sing"}, "mode"),
    "speed": ({"speed": 0.1}, "speed"),
    "unknown-text-input": ({"text_input": "sideways"}, "text_input"),
    "streamed-text-too-long": ({"text": "x" * 4097, "text_input": "streamed"}, "text"),
    "streamed-chat": ({"mode": "chat", "text_input": "streamed"}, ("mode", "text_input")),
}


@pytest.mark.parametrize("case", INVALID, ids=list(INVALID))
def test_invalid_input_is_refused_before_anything_is_admitted(engine, case: str) -> None:
    fields, param = INVALID[case]
    bad = SpeechRequest(**{"request_id": rid("bad"), "text": "Hello there.", "lengths": FRAMES,
                           **fields})
    with pytest.raises(InvalidRequestError) as refused:
        engine.validate(bad)
    assert refused.value.param in (param if isinstance(param, tuple) else (param,))

    async def run():
        sink = Sink()
        with pytest.raises(InvalidRequestError):
            engine.submit([bad])
        with pytest.raises(InvalidRequestError):
            engine.submit_to([bad], sink)
        # all or none: a good request beside a bad one is not admitted either (an open input
        # would keep it queued or running, and its id would be taken)
        good = streamed(rid("good"), SPEAKABLE_START)
        with pytest.raises(InvalidRequestError):
            engine.submit([good, bad])
        with pytest.raises(InvalidRequestError):
            engine.submit_to([good, bad], sink)
        assert_quiet(engine)
        with pytest.raises(InvalidRequestError) as unknown:
            engine.feed_text(good.request_id, " more.")
        assert unknown.value.code == "unknown_stream"
        # nothing holds either id: the good request, and the bad id made good, are served now
        ok = whole(bad.request_id, "Hello there.")
        streams = engine.submit([good, ok])
        engine.feed_text(good.request_id, " finished.", done=True)
        results = await asyncio.gather(*(drain(s) for s in streams))
        await asyncio.sleep(0)  # a refused submit_to's items, had there been any
        return sink, results

    sink, results = asyncio.run(run())
    assert sink.items == []
    assert [error for _, error in results] == [None, None]
    assert all(chunks >= 1 for chunks, _ in results)
    assert_quiet(engine)


def test_a_request_id_in_use_is_refused(engine) -> None:
    async def run():
        running = streamed(rid("taken"), SPEAKABLE_START)
        (stream,) = engine.submit([running])
        with pytest.raises(InvalidRequestError) as taken:
            engine.submit([whole(running.request_id)])
        twice = rid("twice")
        with pytest.raises(InvalidRequestError):
            engine.submit([whole(twice), whole(twice)])
        engine.feed_text(running.request_id, " finished.", done=True)
        chunks = await chunks_of(stream)  # the running stream is untouched
        (again,) = engine.submit([whole(twice)])  # the refused batch took nothing
        return taken.value, chunks, await drain(again)

    taken, chunks, (again_chunks, again_error) = asyncio.run(run())
    assert taken.param == "request_id"
    assert chunks[-1].final and len(audio(chunks)) > 0
    assert again_error is None and again_chunks >= 1


# ---- abort --------------------------------------------------------------------------------


def test_abort_ends_a_read_stream_with_request_aborted_and_frees_it(engine) -> None:
    aborted_before = engine.stats().aborted
    long_text = " ".join(f"Sentence {n} of a long text." for n in range(8))
    request = SpeechRequest(rid("gone"), long_text, seed=1, lengths=LengthControls(audio_frames=400))

    async def run():
        (stream,) = engine.submit([request])
        head = await first_chunk(stream)
        engine.abort(request.request_id)
        return head, await drain(stream)

    head, (_, error) = asyncio.run(run())
    assert not head.final and len(head.samples) > 0
    assert isinstance(error, RequestAbortedError)
    assert engine.stats().aborted == aborted_before + 1
    assert_quiet(engine)


async def every_slot_speaks(engine) -> None:
    """As many open streams as the engine has slots all speak at once: none is held by a stream
    that ended (a held slot leaves one waiting for ever: the hang guard fails it)."""
    requests = [streamed(rid("slot"), SPEAKABLE_START) for _ in range(engine.stats().max_slots)]
    streams = engine.submit(requests)
    heads = await asyncio.gather(*(first_chunk(s) for s in streams))
    assert all(len(head.samples) > 0 and not head.final for head in heads)
    for request in requests:
        engine.abort(request.request_id)
    results = await asyncio.gather(*(drain_guarded(s) for s in streams))
    assert all(isinstance(error, RequestAbortedError) for _, error in results)


@pytest.mark.parametrize("how", ["abort", "reader-stops"])
def test_a_stream_ended_early_frees_its_slot_and_its_text_input(engine, how: str) -> None:
    """An open input never ends by itself: only the abort (or the reader leaving, which
    aborts) ends it."""
    aborted_before = engine.stats().aborted
    request = streamed(rid(how), SPEAKABLE_START)

    async def run():
        (stream,) = engine.submit([request])
        head = await first_chunk(stream)
        running = engine.stats().active_streams
        if how == "abort":
            engine.abort(request.request_id)
            _, error = await drain_guarded(stream)
            assert isinstance(error, RequestAbortedError)
        else:
            await stream.aclose()  # the reader stops early
        with pytest.raises(InvalidRequestError) as fed:
            engine.feed_text(request.request_id, " more.")
        await every_slot_speaks(engine)
        return head, running, fed.value.code

    head, running, code = asyncio.run(run())
    assert len(head.samples) > 0 and not head.final
    assert running == 1
    assert code == "unknown_stream"
    slots = engine.stats().max_slots
    assert engine.stats().aborted == aborted_before + 1 + slots
    assert_quiet(engine)


def test_abort_through_a_sink_ends_with_request_aborted_and_nothing_after(engine) -> None:
    aborted, other = streamed(rid("sink-aborted"), SPEAKABLE_START), whole(rid("sink-other"))

    async def run():
        sink = Sink()
        engine.submit_to([aborted, other], sink)
        await sink.wait_until(lambda: sink.of(aborted.request_id))  # it is speaking
        engine.abort(aborted.request_id)
        await sink.wait_ended(aborted.request_id, other.request_id)
        ended_with = list(sink.of(aborted.request_id))
        # the engine works on (a whole request, start to end) and sends it nothing more
        after = whole(rid("sink-after"))
        engine.submit_to([after], sink)
        await sink.wait_ended(after.request_id)
        return sink, ended_with

    sink, ended_with = asyncio.run(run())
    assert isinstance(ended_with[-1], RequestAbortedError)
    assert all(isinstance(item, AudioChunk) and not item.final for item in ended_with[:-1])
    assert sink.of(aborted.request_id) == ended_with
    assert sink.of(other.request_id)[-1].final  # the other stream finished
    assert_quiet(engine)


def test_a_failing_sink_loses_only_its_own_items(engine) -> None:
    def broken(items: list) -> None:
        raise RuntimeError("this reader is broken")

    async def run():
        engine.submit_to([whole(rid("broken-reader"))], broken)
        sink = Sink()
        good = whole(rid("good-reader"))
        engine.submit_to([good], sink)
        await sink.wait_ended(good.request_id)
        return sink.of(good.request_id)

    items = asyncio.run(run())
    assert items[-1].final and len(audio(items)) > 0
    # the engine still serves
    assert len(spoken_alone(engine, whole(rid("after-broken")))) > 0


# ---- warmup -------------------------------------------------------------------------------

def test_warmup_runs_a_throwaway_request_and_leaves_the_engine_free(engine) -> None:
    completed = engine.stats().completed
    engine.warmup()
    assert_quiet(engine)
    assert len(spoken_alone(engine, whole(rid("after-warmup")))) > 0
    assert engine.stats().completed >= completed + 1
