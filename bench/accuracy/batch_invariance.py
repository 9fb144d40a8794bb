#!/usr/bin/env python3
"""Do batched greedy codes equal single-stream codes on this device and dtype?

Builds full-size random weights (the real config's shapes), runs ``--streams`` greedy read
requests and ``--chat-streams`` greedy chat requests one at a time and then all together
(staggered), and compares every stream's codes (and, for chat, the answer it spoke: batched chat
steps go through the LLM prefill graphs and the LLM step that overlaps the TTS work).
Writes a JSON with the agreement per dtype (fp32 is expected to agree exactly; bf16 reductions
differ with the batch shape, so some streams may diverge after a near-tie).
``--voices N`` registers N cloned voices (synthetic clips) and gives the streams, round-robin,
the default voice and those voices, so voice turns of different lengths share the prefill
batches (their cached keys and values, the prefix graphs on a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np
import torch

from serve_app.engines.base import LengthControls, SamplingParams, SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.loader import load_speech_model
from serve_app.engines.minicpmo.model.synthetic import (
    random_speech_model,
    synthetic_voice_clip,
)

ROOT = Path(__file__).resolve().parents[2]

TEXTS = ["The quick brown fox jumps over the lazy dog near the quiet river bank.",
         "Streaming speech synthesis turns text into audio while the text is still arriving.",
         "Numbers like 1234 and 56 are read digit by digit.",
         "Thank you for listening, and have a wonderful day ahead."]


def codes_of(engine: MiniCPMOEngine, request_id: str) -> np.ndarray:
    trace = engine.trace(request_id)
    frames = [f for segment in trace.finished_segments for f in segment]
    return np.asarray(frames)


async def run(engine: MiniCPMOEngine, requests: list[SpeechRequest], stagger_s: float) -> dict[str, str]:
    """Run the requests (the i-th after ``i * stagger_s``); returns the text each one spoke."""
    async def one(request: SpeechRequest, delay: float) -> str:
        await asyncio.sleep(delay)
        (stream,) = engine.submit([request])
        return "".join([chunk.text async for chunk in stream])

    texts = await asyncio.gather(*(one(r, i * stagger_s) for i, r in enumerate(requests)))
    return {r.request_id: text for r, text in zip(requests, texts)}


def check(dtype: torch.dtype, args: argparse.Namespace) -> dict:
    cloning = args.voices > 0
    if args.checkpoint:
        model = load_speech_model(args.checkpoint, device=args.device, dtype=dtype,
                                  audio_encoder=cloning)
    else:
        model = random_speech_model(ROOT / "tests" / "golden" / "chattts_tokenizer", args.device, dtype,
                                    clip_encoder=cloning)
    options = EngineOptions(device=args.device, max_slots=max(args.streams + args.chat_streams, 2),
                            max_chat_slots=max(args.chat_streams, 1), tts_max_positions=1024,
                            llm_max_positions=1024 if cloning else 256, tts_sampling="greedy",
                            keep_traces=True, cuda_graphs=not args.no_graphs, voices=cloning,
                            max_voices=max(args.voices, 1))
    engine = MiniCPMOEngine(model, options)
    voices = ["default"] + [f"voice-{i}" for i in range(args.voices)]
    for index, voice in enumerate(voices[1:]):  # clips of 2 to 6 s: voice turns of many lengths
        clip = synthetic_voice_clip(index, seconds=2.0 + 4.0 * index / max(args.voices - 1, 1))
        engine.add_voice(voice, engine.embed_voice(clip, 16_000))
    lengths = LengthControls(ignore_eos=True, audio_frames=args.frames)

    chat_lengths = LengthControls(ignore_eos=True, audio_frames=args.frames, llm_tokens=30)
    greedy = SamplingParams(temperature=0.0)

    def request(index: int, tag: str) -> SpeechRequest:
        voice = voices[index % len(voices)]
        if index >= args.streams:
            return SpeechRequest(request_id=f"{tag}-{index}", text=TEXTS[index % len(TEXTS)], mode="chat",
                                 sampling=greedy, lengths=chat_lengths, voice=voice)
        return SpeechRequest(request_id=f"{tag}-{index}", text=TEXTS[index % len(TEXTS)],
                             mode="read", lengths=lengths, voice=voice)

    total = args.streams + args.chat_streams
    spoken: dict[str, str] = {}
    for index in range(total):
        spoken.update(asyncio.run(run(engine, [request(index, "alone")], 0.0)))
    spoken.update(asyncio.run(run(engine, [request(i, "batched") for i in range(total)], args.stagger_s)))
    agree, first_divergence = 0, []
    chat_same = sum(spoken[f"alone-{i}"] == spoken[f"batched-{i}"] for i in range(args.streams, total))
    for index in range(total):
        alone, batched = codes_of(engine, f"alone-{index}"), codes_of(engine, f"batched-{index}")
        same = alone.shape == batched.shape and np.array_equal(alone, batched)
        agree += same
        if not same:
            n = min(len(alone), len(batched))
            diff = np.nonzero(np.any(alone[:n] != batched[:n], axis=1))[0]
            first_divergence.append(int(diff[0]) if len(diff) else n)
    engine.close()
    del engine, model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"dtype": str(dtype).replace("torch.", ""), "streams": total, "read_streams": args.streams,
            "chat_streams": args.chat_streams, "frames": args.frames, "voices": args.voices,
            "identical_streams": agree, "agreement": agree / total,
            "chat_answers_identical": chat_same, "first_divergent_frame": first_divergence}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--chat-streams", type=int, default=4)
    parser.add_argument("--frames", type=int, default=150)
    parser.add_argument("--stagger-s", type=float, default=0.05)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--voices", type=int, default=0,
                        help="cloned voices the streams use round-robin with the default voice")
    parser.add_argument("--checkpoint", default=None,
                        help="a model folder instead of full-size random weights (e.g. the tests' tiny one)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "batch-invariance.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    results = [check(getattr(torch, name), args) for name in args.dtypes]
    report = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "results": results, "seconds": time.perf_counter() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
