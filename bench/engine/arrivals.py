"""A level's requests and when they arrive: the texts, each request's length controls and voice,
and the submission times of a burst or of Poisson arrivals holding N streams."""

from __future__ import annotations

import argparse
import random
import time

from serve_app.engines.base import LengthControls, SamplingParams, SpeechRequest
FRAMES_PER_SECOND = 46.875
READ_TEXT = ("Streaming speech synthesis turns text into audio while the text is still arriving. "
             "The weather today is sunny and warm, and I hope you have a wonderful day ahead. ")
CHAT_TEXT = "Tell me something nice about the sea."


def voice_id(index: int) -> str:
    return f"bench-voice-{index}"


def make_request(index: int, mode: str, args: argparse.Namespace,
                 voice: str | None = None) -> SpeechRequest:
    """The index-th request of a level: in cloned voice ``index % --voices`` when there are
    voices (``voice`` overrides)."""
    frames = int(round(args.audio_seconds * FRAMES_PER_SECOND))
    lengths = LengthControls(ignore_eos=True, audio_frames=frames,
                             llm_tokens=args.chat_tokens if mode == "chat" else None)
    if voice is None:
        voice = voice_id(index % args.voices) if getattr(args, "voices", 0) else "default"
    return SpeechRequest(request_id=f"{mode}-{index}-{time.monotonic_ns()}",
                         text=READ_TEXT if mode == "read" else CHAT_TEXT, mode=mode, voice=voice,
                         seed=index, sampling=SamplingParams(temperature=0.7, max_new_tokens=4096),
                         lengths=lengths)


def arrival_delays(concurrency: int, arrival: str, audio_seconds: float) -> list[float]:
    """When each request of a level is submitted, in seconds from its start: ``burst``, all
    ``concurrency`` at once; ``poisson``, ``2 * concurrency`` (at least 4) Poisson arrivals whose
    rate keeps about ``concurrency`` streams of ``audio_seconds`` active (seeded by the level)."""
    rng = random.Random(concurrency)
    if arrival == "burst":
        return [0.0] * concurrency
    total = max(concurrency * 2, 4)
    mean_duration = audio_seconds * 1.05
    rate = concurrency / mean_duration
    t, delays = 0.0, []
    for _ in range(total):
        delays.append(t)
        t += rng.expovariate(rate)
    return delays
