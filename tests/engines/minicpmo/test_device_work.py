"""The runner's count of device work (ModelRunner.work, read by scripts/bench_engine.py's
roofline): it follows what the engine did (tiny checkpoint, CPU)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.engines.base import LengthControls, SpeechRequest
from tests.engines.minicpmo.tiny_engine import tiny_engine

FRAMES = LengthControls(audio_frames=40)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = tiny_engine(tiny_checkpoint, max_slots=4, max_chat_slots=2)
    yield engine
    engine.close()


def test_device_work_counts_what_the_engine_did(engine) -> None:
    before_work, before_stats = engine.device_work(), engine.stats()

    async def run() -> list:
        streams = engine.submit([
            SpeechRequest("read-work", "Counting the work of one read stream.", lengths=FRAMES),
            SpeechRequest("chat-work", "Say something short.", mode="chat", lengths=FRAMES)])

        async def last(stream):
            return [chunk async for chunk in stream][-1]

        return await asyncio.gather(*(last(s) for s in streams))

    finals = asyncio.run(run())
    work = {k: v - before_work.get(k, 0) for k, v in engine.device_work().items()}
    stats = engine.stats()
    assert work["llm_steps"] == stats.llm_steps - before_stats.llm_steps > 0
    assert work["llm_prefill_passes"] >= 1 and work["llm_prefill_tokens"] > 0
    assert work["audio_frame_steps"] == work["audio_windows"] * engine.options.steps_per_sync
    assert 0 < work["audio_windows"] <= stats.steps - before_stats.steps
    frames = sum(int(chunk.timings_s["tts_steps"]) for chunk in finals)
    assert work["decode_frames"] >= frames  # each frame decoded once, some again as context
    assert work["text_prefill_passes"] >= 2 and work["text_prefill_key_reads"] > 0
