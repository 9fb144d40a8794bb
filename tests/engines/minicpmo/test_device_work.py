"""The runner's count of device work (ModelRunner.work, read by bench/engine/run.py's
roofline): it follows what the engine did (tiny checkpoint, CPU)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve_app.engines.base import LengthControls, SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.loader import load_speech_model
from tests.engines.minicpmo.tiny_engine import tiny_engine

FRAMES = LengthControls(audio_frames=40)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = tiny_engine(tiny_checkpoint, max_slots=4, max_chat_slots=2)
    yield engine
    engine.close()


def test_device_work_counts_what_the_engine_did(engine) -> None:
    before_work, before_stats = engine.device_work(), engine.stats()
    before_phases = engine.step_phase_seconds()

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
    # host time by phase (served busy periods log it): every phase ran, and together they are
    # the steps' time less the bookkeeping around each step
    phases = {name: seconds - before_phases.get(name, 0.0)
              for name, seconds in engine.step_phase_seconds().items()}
    assert set(phases) == {"admit_prefill", "llm_decode", "schedule", "tts_prefill", "tts_step",
                           "decode_emit"}
    assert all(seconds > 0 for seconds in phases.values())
    assert sum(phases.values()) <= stats.step_seconds - before_stats.step_seconds


def test_step_log_records_each_step_and_each_admission_wait(engine) -> None:
    """The step log (read by bench/engine/run.py to say what a tail is made of): one record
    per step, in order, each stream's wait for admission in the step that admitted it."""
    import time

    since = time.perf_counter()

    async def run() -> None:
        streams = engine.submit([SpeechRequest(f"log-{i}", "Logging the steps.", lengths=FRAMES)
                                 for i in range(3)])
        for stream in streams:
            async for _ in stream:
                pass

    asyncio.run(run())
    log = engine.step_log(since)
    # every step the engine counted is in the log. This in-process reader gets each chunk the
    # moment it is made, so its last one may come before its step is counted and logged: wait
    # for the two to agree (a step missing from the log never would)
    deadline = time.monotonic() + 60
    while len(engine.step_log()) != engine.stats().steps:
        assert time.monotonic() < deadline, (len(engine.step_log()), engine.stats().steps)
        time.sleep(0.01)
    assert [r.started_s for r in log] == sorted(r.started_s for r in log)
    waits = [wait for record in log for wait in record.queue_waits_s]
    assert len(waits) == 3 and all(wait >= 0 for wait in waits)
    assert all(record.seconds > 0 for record in log)
    assert max(record.generating for record in log) >= 1
    assert engine.step_log(time.perf_counter()) == []
    assert all(record.gc_s >= 0 for record in log)
    # each step says how long each phase took and what the device did in it
    assert all(dict(record.phases_s).keys() >= {"admit_prefill", "tts_step", "decode_emit"}
               for record in log)
    assert all(sum(s for _, s in record.phases_s) <= record.seconds for record in log)
    assert sum(dict(record.work).get("llm_prefill_passes", 0) for record in log) >= 1
    windows = [dict(record.work).get("audio_windows", 0) for record in log]
    assert set(windows) <= {0, 1} and sum(windows) >= 1
    assert all((dict(record.work).get("audio_windows", 0) == 1) == (record.generating > 0)
               for record in log)


def test_garbage_collection_clock_counts_collections_until_closed() -> None:
    import gc

    from serve_app.engines.minicpmo.step.gc_clock import GarbageCollectionClock

    clock = GarbageCollectionClock()
    gc.collect()
    counted = clock.total_s
    assert counted > 0
    clock.close()
    gc.collect()
    assert clock.total_s == counted


def test_prefill_budgets_spread_admissions_over_passes(tiny_checkpoint) -> None:
    """Streams queued together are admitted while their prompts fit one prefill pass of
    ``prefill_tokens`` padded tokens and ``prefill_prompts`` prompts: a budget of one token
    admits one stream a step (a pass each), two prompts a step two passes, the defaults all
    three in one pass; the speech and the chat answers are the same every way."""
    from serve_app.engines.minicpmo.device.runner import fits_one_pass

    assert fits_one_pass([5, 7, 3], 21) and not fits_one_pass([5, 7, 3], 20)
    assert fits_one_pass([300], 8)  # one prompt always fits, however long
    assert fits_one_pass([2, 2], 4) and not fits_one_pass([2, 3], 5)

    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    requests = [("budget-read-a", "The first of three prompts.", "read"),
                ("budget-read-b", "A second, somewhat longer prompt to read aloud.", "read"),
                ("budget-chat", "Say something short.", "chat")]
    results = {}
    budgets = {"one token": {"prefill_tokens": 1}, "two prompts": {"prefill_prompts": 2},
               "defaults": {}}
    for budget, limits in budgets.items():
        engine = MiniCPMOEngine(model, EngineOptions(
            model=str(tiny_checkpoint), device="cpu", dtype="float32", max_slots=4,
            admission="slots",
            max_chat_slots=2, tts_max_positions=1024, llm_max_positions=256,
            tts_sampling="greedy", keep_traces=True, **limits))
        try:
            before = engine.device_work().get("llm_prefill_passes", 0)

            async def run() -> None:
                streams = engine.submit([SpeechRequest(rid, text, mode=mode, lengths=FRAMES)
                                         for rid, text, mode in requests])
                async def drain(stream) -> None:
                    async for _ in stream:
                        pass

                await asyncio.gather(*(drain(s) for s in streams))

            asyncio.run(run())
            passes = engine.device_work()["llm_prefill_passes"] - before
            traces = {rid: engine.trace(rid) for rid, _, _ in requests}
            results[budget] = (passes, {rid: (t.gen_text_raw, t.finished_segments + [t.segment_frames])
                                        for rid, t in traces.items()})
        finally:
            engine.close()
    assert [results[b][0] for b in budgets] == [3, 2, 1]
    assert results["one token"][1] == results["two prompts"][1] == results["defaults"][1]
