"""A window's frames recorded at once (SpeechSchedule.on_frames) leave a schedule exactly as one
frame at a time does: the same state, decode jobs and follow-up work, with cuts inside windows,
calls that end, end-of-audio, the frame limit and carried segments."""

from __future__ import annotations

import random

import pytest

from serve_app.engines.minicpmo.model.modeling import TTSConfig
from serve_app.engines.minicpmo.speech_schedule import Phase, SpeechSchedule

CONFIG = TTSConfig(llm_dim=8, hidden_size=8, intermediate_size=8, num_attention_heads=1,
                   num_hidden_layers=1)
TEXT = ("A first sentence of some length that goes on. Then a second one, with a comma, and "
        "then more words. " * 3)


def schedule(ignore_eos: bool, cuts: set[int], limit: int | None) -> SpeechSchedule:
    return SpeechSchedule(config=CONFIG, tokenize=lambda text: [ord(c) for c in text],
                          decode_tokens=lambda ids: "".join(map(chr, ids)), extra_cuts=set(cuts),
                          ignore_eos=ignore_eos, total_frame_limit=limit, max_segment_frames=60)


def state(s: SpeechSchedule) -> tuple:
    return (s.phase, s.cache_len, s.call_frames, s.frames_total, s.segment_frames, s.call_lengths,
            s.decoded_upto, s.chunk_index, s.in_tail, s.carried_segment, s.stopped)


def run(seed: int, one_at_a_time: bool) -> list:
    rng = random.Random(seed)
    ignore_eos = rng.random() < 0.5
    s = schedule(ignore_eos, set(rng.sample(range(3, 120), 12)), rng.choice([None, 90, 137]))
    pieces = [TEXT[i:i + 7] for i in range(0, len(TEXT), 7)]
    log: list = []
    for _ in range(400):  # engine steps: text for a waiting schedule, else a window of frames
        if s.phase is Phase.DONE:
            break
        if s.phase is Phase.WAITING_TEXT:
            log.append(("text", s.accept_piece(pieces.pop(0)) if pieces else s.end_of_text()))
            continue
        step = s.next_step()
        frames = []
        for index in range(min(5, step.steps_left)):  # the device stops at the call's end ...
            eos = (not ignore_eos and step.call_frames + index + 1 >= 2 and rng.random() < 0.03)
            frames.append([CONFIG.eos_code] * 4 if eos else [rng.randrange(625) for _ in range(4)])
            if eos:  # ... or at end-of-audio
                break
        jobs = ([job for codes in frames for job in s.on_frame(codes)] if one_at_a_time
                else s.on_frames(frames))
        log.append(("window", jobs, state(s)))
    return log


@pytest.mark.parametrize("seed", range(30))
def test_a_window_at_once_is_the_frames_one_by_one(seed: int) -> None:
    assert run(seed, one_at_a_time=False) == run(seed, one_at_a_time=True)
