"""How exact the Piper engine's word timestamps are, checked against two sources of their own.

1. **The audio.** At a comma, a sentence end or another clause mark the voice pauses. Between
   the word before the mark and the word after it the audio must be quiet, and the quiet run
   found in the audio itself (10 ms frames under a level set from the words' own loudness)
   must begin where the first word ends and end where the second begins. Error: the distance
   from each of those word edges to the quiet run's edge.
2. **espeak-ng's own word events** (``espeakEVENT_WORD`` from espeak-ng's synthesizer, the
   library piper-tts ships, reached with ctypes): each word's start in espeak-ng's own
   (formant) speech, mapped onto Piper's timeline by the least-squares line through both
   texts' word starts. The two voices speak at their own pace and pause differently, so this
   is a coarse check of order and proportion, not of milliseconds.

Run from the repository root (no service needed: the engine runs in this process)::

    python -m bench.accuracy.word_timing [--out docs/word-timing.json]

It prints the figures and writes them, with the commit, to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import subprocess
import time
from pathlib import Path

import numpy as np

from serve_app.engines.base import SpeechRequest
from serve_app.engines.registry import create_engine
from serve_app.engines.words import WordTime, split_words

ROOT = Path(__file__).resolve().parents[2]
FRAME_S = 0.01
QUIET_LEVEL = 0.1  # a frame is quiet under this fraction of the words' RMS
CLAUSE_MARKS = ",.;:!?"

TEXTS = [
    "Hello there, my name is Joe. I read text aloud for machines without a graphics card.",
    "First, open the box; then, carefully, lift the lid. What do you see inside?",
    "The train leaves at seven, the bus at eight, and the ferry at nine. Which one is yours?",
    "Of the 1887 letters, Dr. Smith kept twelve. The rest went to the archive in 2024!",
    "When the rain stopped, we walked home. It was late, and everyone was tired.",
    "Apples, pears, plums and cherries grow here. The orchard is old, but it still gives fruit.",
    "If you need help, press the button twice. Someone will answer within a minute.",
    "She said yes. He said no. They argued for an hour, and then they laughed about it.",
    "Our service streams audio as it is made, so the first words arrive quickly. Try it now.",
    "Well, that depends. On Mondays the shop opens at nine; on Sundays, it stays closed.",
    "The weather today is sunny, with a light breeze from the west. Tomorrow may bring rain.",
    "Please read the instructions, then sign at the bottom. Thank you, and have a nice day!",
]


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p),
                ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):  # espeak_EVENT, speak_lib.h
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint),
                ("text_position", ctypes.c_int), ("length", ctypes.c_int),
                ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _EventId)]


_EVENT_WORD, _AUDIO_OUTPUT_SYNCHRONOUS, _POS_CHARACTER, _CHARS_UTF8 = 1, 2, 1, 1


def espeak_word_starts(texts: list[str], voice: str) -> list[list[float | None]]:
    """Per text, each word's start (s) in espeak-ng's own speech (None: no event of its own)."""
    from piper import espeakbridge
    from piper.phonemize_espeak import ESPEAK_DATA_DIR

    library = ctypes.CDLL(espeakbridge.__file__)
    events: list[tuple[int, int]] = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                      ctypes.POINTER(_Event))
    def on_audio(_wav, _samples, event_list):
        index = 0
        while event_list[index].type != 0:
            event = event_list[index]
            if event.type == _EVENT_WORD:
                events.append((event.text_position, event.audio_position))
            index += 1
        return 0

    library.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, str(ESPEAK_DATA_DIR).encode(), 0)
    library.espeak_SetSynthCallback(on_audio)
    library.espeak_SetVoiceByName(voice.encode())
    starts = []
    for text in texts:
        events.clear()
        data = text.encode()
        library.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        spans, at = [], 0
        for word in split_words(text):
            at = text.index(word, at)
            spans.append((at + 1, at + len(word)))  # espeak's positions count from 1
            at += len(word)
        starts.append([next((ms / 1000 for position, ms in events if first <= position <= last),
                            None) for first, last in spans])
    return starts


async def _speak(engine, text: str, index: int) -> tuple[list[WordTime], np.ndarray, int]:
    [stream] = engine.submit([SpeechRequest(f"timing-{index}", text, seed=0, word_times=True)])
    chunks = [chunk async for chunk in stream]
    words = [word for chunk in chunks for word in chunk.words]
    return words, np.concatenate([chunk.samples for chunk in chunks]), chunks[0].sample_rate_hz


def pause_errors(words: list[WordTime], audio: np.ndarray, rate: int) -> list[dict]:
    """At each clause mark: the quiet run between the two words, its edges' distance to the
    words' edges (ms), and how quiet the gap is against the words."""
    frame = int(FRAME_S * rate)
    frames = len(audio) // frame
    rms = np.sqrt(np.mean(np.square(audio[:frames * frame].reshape(frames, frame)), axis=1))
    spoken = np.concatenate([audio[int(w.start_s * rate):int(w.end_s * rate)] for w in words])
    level = QUIET_LEVEL * float(np.sqrt(np.mean(np.square(spoken))))
    found = []
    for before, after in zip(words, words[1:]):
        if before.word[-1] not in CLAUSE_MARKS:
            continue
        # The longest quiet run of frames from 150 ms before the first word's end to 150 ms
        # after the second's start.
        lo = max(0, int((before.end_s - 0.15) / FRAME_S))
        hi = min(frames, int((after.start_s + 0.15) / FRAME_S))
        best, run_start = (0, lo, lo), None
        for index in range(lo, hi + 1):
            quiet = index < hi and rms[index] < level
            if quiet and run_start is None:
                run_start = index
            if not quiet and run_start is not None:
                best = max(best, (index - run_start, run_start, index))
                run_start = None
        _, quiet_from, quiet_to = best
        gap = audio[int(before.end_s * rate):int(after.start_s * rate)]
        found.append({
            "between": [before.word, after.word],
            "end_error_ms": round((before.end_s - quiet_from * FRAME_S) * 1000, 1),
            "start_error_ms": round((after.start_s - quiet_to * FRAME_S) * 1000, 1),
            "gap_ms": round((after.start_s - before.end_s) * 1000, 1),
            "gap_rms_vs_words": round(float(np.sqrt(np.mean(np.square(gap)))) / level
                                      * QUIET_LEVEL, 4) if gap.size else None,
        })
    return found


def espeak_errors(words: list[WordTime], espeak_starts: list[float | None]) -> list[float]:
    """|Piper start - espeak start mapped by the least-squares line| per word (ms)."""
    pairs = [(e, w.start_s) for w, e in zip(words, espeak_starts) if e is not None]
    x, y = np.array(pairs).T
    slope, intercept = np.polyfit(x, y, 1)
    return [abs(float(value)) * 1000 for value in y - (slope * x + intercept)]


def phonemizing_cost_ms(engine, text: str) -> dict[str, float]:
    """What word times add to phonemizing ``text`` on the step thread: plain pieces, pieces
    with words on a cold word cache, then again (warm); best of 3 each (ms)."""
    from serve_app.engines.piper.piper_text import Phonemizer

    def best(call) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        return round(min(times) * 1000, 2)

    phonemizer = engine._phonemizer
    cold = []
    for _ in range(3):
        fresh = Phonemizer(engine._voice, 400, 0)
        started = time.perf_counter()
        fresh.word_pieces(text)
        cold.append(time.perf_counter() - started)
    return {"chars": len(text), "plain_ms": best(lambda: phonemizer.phonemize(text)),
            "words_cold_ms": round(min(cold) * 1000, 2),
            "words_warm_ms": best(lambda: phonemizer.word_pieces(text))}


def summary(values: list[float]) -> dict[str, float]:
    values_abs = np.abs(np.array(values))
    return {"n": int(values_abs.size), "mean_ms": round(float(values_abs.mean()), 1),
            "p90_ms": round(float(np.percentile(values_abs, 90)), 1),
            "max_ms": round(float(values_abs.max()), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "word-timing.json"))
    args = parser.parse_args()
    engine = create_engine("piper", {"intra_op_threads": 2, "max_batch_size": 1})

    async def speak_all():
        return [await _speak(engine, text, index) for index, text in enumerate(TEXTS)]

    spoken = asyncio.run(speak_all())
    cost = phonemizing_cost_ms(engine, " ".join(TEXTS))
    engine.close()
    for text, (words, _, _) in zip(TEXTS, spoken):
        assert [w.word for w in words] == split_words(text), text
    pauses = [p for words, audio, rate in spoken for p in pause_errors(words, audio, rate)]
    ends = [p["end_error_ms"] for p in pauses]
    starts = [p["start_error_ms"] for p in pauses]
    espeak = espeak_word_starts(TEXTS, "en-us")
    against_espeak = [e for (words, _, _), starts in zip(spoken, espeak)
                      for e in espeak_errors(words, starts)]
    result = {
        "what": "Piper word timestamps against the audio's pauses and espeak-ng's word events",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "command": "python -m bench.accuracy.word_timing",
        "texts": len(TEXTS), "words": sum(len(words) for words, _, _ in spoken),
        "pauses": len(pauses),
        "pauses_quiet": sum(1 for p in pauses if p["gap_rms_vs_words"] is not None
                            and p["gap_rms_vs_words"] < QUIET_LEVEL),
        "pause_edge_error": summary(ends + starts),
        "word_start_error": summary(starts),  # the word after a pause against the audio
        "word_end_error": summary(ends),  # the word before it
        # signed means: > 0, the timestamp lies later than the audio's edge
        "word_start_bias_ms": round(float(np.mean(starts)), 1),
        "word_end_bias_ms": round(float(np.mean(ends)), 1),
        "espeak_word_events": {**summary(against_espeak),
                               "words_without_event": sum(s is None for t in espeak for s in t)},
        "phonemizing_cost": cost,
        "pause_detail": pauses,
    }
    Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n",
                              encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "pause_detail"}, indent=1,
                     ensure_ascii=False))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
