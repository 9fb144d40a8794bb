"""Streamed text input on the MiniCPM-o engine (tiny checkpoint, CPU): text fed while the
request runs is spoken as it arrives, cut exactly as the whole text would be."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.engines.base import LengthControls, SpeechRequest
from serve_app.engines.minicpmo.engine import MiniCPMOEngine, StreamPlan
from serve_app.engines.minicpmo.model.modeling import TTSConfig
from serve_app.engines.minicpmo.speech_schedule import Phase, SpeechSchedule
from serve_app.engines.streamed_text import clause_ends
from tests.engines.minicpmo.tiny_engine import tiny_engine
from tests.engines.streams import drain

TEXT = ("Streaming text arrives a few words at a time, and the speech follows it closely. "
        "Nothing here waits for the last word.")
# Random tiny weights never stop by themselves: a fixed length of several generate calls.
FRAMES = LengthControls(audio_frames=80)

pytestmark = pytest.mark.timeout(900)  # guards against a hang only; nothing here is timed


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = tiny_engine(tiny_checkpoint, max_slots=3, max_chat_slots=1)
    yield engine
    engine.close()


def streamed(request_id: str, text: str = "", **fields) -> SpeechRequest:
    return SpeechRequest(request_id, text, text_input="streamed", lengths=FRAMES, **fields)


def codes(engine: MiniCPMOEngine, request_id: str) -> tuple[list, list]:
    trace = engine.trace(request_id)
    return trace.finished_segments, trace.call_lengths


def test_audio_starts_before_the_input_is_done(engine) -> None:
    async def run():
        (stream,) = engine.submit([streamed("early")])
        engine.feed_text("early", "Streaming text arrives a few words at ")
        engine.feed_text("early", "a time, and the speech follows it closely. ")
        first = await anext(stream)  # the input is still open: this audio came before done
        engine.feed_text("early", "Nothing here waits for the last word.", done=True)
        return first, [chunk async for chunk in stream]

    first, rest = asyncio.run(run())
    assert len(first.samples) > 0 and not first.final
    assert rest[-1].final
    assert sum(len(segment) for segment in codes(engine, "early")[0]) == FRAMES.audio_frames


def test_text_fed_in_parts_gives_the_codes_of_the_whole_text(engine) -> None:
    """Deltas that split words anywhere: the pieces, and so the greedy codes, are those of the
    whole text spoken with the same prompt (the prompt holds the text known at submission)."""
    prompt = engine.plan(streamed("probe")).prompt
    pieces = engine.plan(SpeechRequest("probe", TEXT)).pieces
    deltas = [TEXT[a:b] for a, b in zip((0, 7, 9, 40, 41, 95), (7, 9, 40, 41, 95, len(TEXT)))]

    async def run():
        whole = engine.submit_plans([StreamPlan(SpeechRequest("whole", TEXT, lengths=FRAMES),
                                                prompt, pieces)])
        (parts,) = engine.submit([streamed("parts")])
        for delta in deltas:
            engine.feed_text("parts", delta)
            await asyncio.sleep(0)
        engine.feed_text("parts", "", done=True)
        return await asyncio.gather(drain(whole[0]), drain(parts))

    assert [error for _, error in asyncio.run(run())] == [None, None]
    assert codes(engine, "parts") == codes(engine, "whole")
    assert engine.trace("parts").gen_text_raw == engine.trace("whole").gen_text_raw


def test_all_text_at_submission_equals_the_whole_text_request(engine) -> None:
    async def run():
        streams = engine.submit([SpeechRequest("at-once", TEXT, lengths=FRAMES),
                                 streamed("at-once-streamed", TEXT)])
        engine.feed_text("at-once-streamed", "", done=True)
        return await asyncio.gather(*(drain(s) for s in streams))

    assert [error for _, error in asyncio.run(run())] == [None, None]
    assert codes(engine, "at-once-streamed") == codes(engine, "at-once")


def test_input_that_ends_with_nothing_speakable_ends_the_stream_without_audio(engine) -> None:
    async def run():
        (stream,) = engine.submit([streamed("silent", "...")])
        engine.feed_text("silent", " !?", done=True)
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert [chunk.final for chunk in chunks] == [True] and len(chunks[0].samples) == 0


def test_text_feed_cuts_the_pieces_of_the_whole_text_wherever_the_text_is_split(engine) -> None:
    text = "Caf\u00e9 na\u00efve \u4f60\u597d\u4e16\u754c. Let's go,  don't stop!\nNew line: 3.14 apples"
    whole = engine.plan(SpeechRequest("w", text)).pieces
    for size in (1, 2, 3, 5, 8, 13):
        feed = engine.plan(streamed("s")).text_feed
        got = [piece for start in range(0, len(text), size)
               for piece in feed.push(text[start:start + size])]
        assert got + feed.finish() == whole, size


# A stream that waits for more text gets none within this (the WebSocket's idle timeout is 20 s):
# without a cut at the last break, the test fails here instead of hanging.
FIRST_AUDIO_WITHIN_S = 15.0


def _break_point(engine, text: str) -> tuple[list[str], tuple[str, str] | None]:
    feed = engine.plan(streamed("probe")).text_feed
    return feed.push(text), feed.break_point()


@pytest.mark.parametrize("fed", ["Well, you see, I", "Hi, you see"])
def test_text_that_stops_after_a_comma_is_spoken_up_to_it_before_the_input_ends(
        engine, fed: str) -> None:
    """Fewer than ten TTS tokens, no sentence end, the input open: nothing would start the
    speech before more text or the end of the input; a pause cuts it at its last break."""
    request_id = f"stops-{len(fed)}"

    async def run():
        # no fixed length (that keeps segments from ending): a cap on the audio instead
        (stream,) = engine.submit([SpeechRequest(request_id, "", text_input="streamed",
                                                 max_audio_s=0.5)])
        fed_at = time.monotonic()
        engine.feed_text(request_id, fed)  # never done
        first = await asyncio.wait_for(anext(stream), FIRST_AUDIO_WITHIN_S)
        waited = time.monotonic() - fed_at
        return first, waited, [chunk async for chunk in stream]

    first, waited, rest = asyncio.run(run())
    assert len(first.samples) > 0 and not first.final and rest[-1].final
    assert waited >= engine.options.text_break_wait_s
    trace = engine.trace(request_id)
    _, (_, after) = _break_point(engine, fed)
    assert (trace.gen_text_raw, trace.text_left) == (fed[:clause_ends(fed)[-1]], after)
    assert trace.in_tail and trace.pending_new_segment


def test_text_feed_break_point_and_cut(engine) -> None:
    # the break in text the feed still holds: it goes out as one piece
    text = "Well, you see, I"
    given, point = _break_point(engine, text)
    end = clause_ends(text)[-1]
    assert len("".join(given)) <= end and point == (text[len("".join(given)):end], "")
    # the break in text already given out in pieces: that text moves past the cut
    text = "Hi, you see"
    given, point = _break_point(engine, text)
    assert len("".join(given)) > clause_ends(text)[-1]
    assert point == ("", text[clause_ends(text)[-1]:len("".join(given))])
    # either way the pieces after the cut are the text after the break
    for text, more in [("Well, you see, I", " think"), ("Hi, you see", " it, I")]:
        feed = engine.plan(streamed("s")).text_feed
        given = "".join(feed.push(text))
        held, after = feed.break_point()
        feed.cut_at_break()
        rest = "".join(feed.push(more)) + "".join(feed.finish())
        assert given + held + rest == text + more
        assert after + rest == text[clause_ends(text)[-1]:] + more
    feed = engine.plan(streamed("s")).text_feed
    feed.push("no break in this")
    assert feed.break_point() is None


def _schedule() -> SpeechSchedule:
    config = TTSConfig(llm_dim=8, hidden_size=8, intermediate_size=8, num_attention_heads=1,
                       num_hidden_layers=1)
    return SpeechSchedule(config=config, tokenize=lambda text: [ord(c) for c in text],
                          decode_tokens=lambda ids: "".join(map(chr, ids)))


def _speak_to_the_end(schedule: SpeechSchedule, frames: int = 12) -> list[object]:
    """Frames of the running tail, the last one end-of-audio; the work that follows."""
    assert schedule.phase is Phase.GENERATING and schedule.in_tail
    for _ in range(frames - 1):
        schedule.on_frame([1, 2, 3, 4])
    return schedule.on_frame([schedule.config.eos_code] * 4)


def test_after_a_cut_at_a_break_the_rest_is_spoken_in_a_carried_segment() -> None:
    schedule = _schedule()
    assert schedule.accept_piece("Well, you") == []
    work = schedule.cut_at_break("", " you")
    assert schedule.gen_text == "Well," and schedule.text_left == " you"
    assert work and work[0].token_ids[-1] == schedule.config.text_eos_token_id
    follow_up = _speak_to_the_end(schedule)
    assert "reset_cache" in follow_up and schedule.phase is Phase.WAITING_TEXT
    assert schedule.gen_text == "Well," + " you"  # the carried text, then what the cut left
    schedule.accept_piece(" see")
    assert schedule.gen_text == "Well, you see"
    # the input ends with no more text: what the cut left is still spoken
    schedule = _schedule()
    schedule.accept_piece("Well, you")
    schedule.cut_at_break("", " you")
    _speak_to_the_end(schedule)
    schedule.end_of_text()
    assert schedule.phase is Phase.GENERATING and schedule.text_ids == [ord(c) for c in "Well, you"]


def test_a_cut_that_left_nothing_ends_the_stream_with_the_input() -> None:
    schedule = _schedule()
    schedule.accept_piece("Well,")
    assert schedule.cut_at_break("", "")
    _speak_to_the_end(schedule)
    schedule.end_of_text()
    assert schedule.phase is Phase.DONE  # the carried text is not spoken twice


def test_no_cut_where_there_is_nothing_new_to_speak_or_the_text_does_not_match() -> None:
    schedule = _schedule()
    assert schedule.cut_at_break("...", "") is None
    schedule.accept_piece("Well, you")
    assert schedule.cut_at_break("", " they") is None
    assert schedule.cut_at_break("", "x" * 20) is None
    assert schedule.phase is Phase.WAITING_TEXT and schedule.gen_text == "Well, you"
