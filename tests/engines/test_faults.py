"""Fault injection on the real Piper engine, and its bounded queue (no Ray)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from serve_app.engines.base import EngineError, EngineOverloadedError, SpeechRequest
from serve_app.engines.faults import CRASH_EXIT_CODE, FaultInjection
from serve_app.engines.piper.piper_engine import PiperEngine
from serve_app.engines.registry import create_engine
from tests.engines.streams import drain

TEXT = "Hello from the serving stack. This second sentence is a little longer. And a third one."
FAULTS = {"fail_request_text": "FAIL", "stall_request_text": "STALL",
          "delay_request_text": "SLOW", "delay_s": 0.5}


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    engine = create_engine("piper", {"intra_op_threads": 1, "max_batch_size": 4,
                                     "max_queued_streams": 2, "fault_injection": FAULTS})
    assert isinstance(engine, PiperEngine)
    yield engine
    engine.close()


def test_injection_is_off_by_default_and_rejects_unknown_options() -> None:
    assert FaultInjection.from_options(None) is None
    assert FaultInjection.from_options({}) is None
    with pytest.raises(ValueError):
        FaultInjection.from_options({"explode": "x"})
    faults = FaultInjection(fail_request_text="F", crash_process_text="C", after_chunks=1)
    assert faults.action("F", 0) is None and faults.action("F", 1) == "fail"
    assert faults.action("C F", 1) == "crash" and faults.action("plain", 5) is None


def test_a_failing_stream_ends_with_an_error_after_its_first_chunk_and_others_finish(
        engine: PiperEngine) -> None:
    async def run():
        iterators = engine.submit([SpeechRequest("ok", TEXT), SpeechRequest("bad", f"FAIL {TEXT}")])
        return await asyncio.gather(*(drain(it) for it in iterators))

    failed = engine.stats().failed
    (good_chunks, good_error), (bad_chunks, bad_error) = asyncio.run(run())
    assert good_error is None and good_chunks == 3
    assert isinstance(bad_error, EngineError) and bad_chunks == 1
    assert engine.stats().failed == failed + 1


def test_stalled_and_slow_streams_hold_back_without_blocking_others(engine: PiperEngine) -> None:
    async def run():
        stalled, slow, plain = engine.submit([SpeechRequest("stall", f"STALL {TEXT}"),
                                              SpeechRequest("slow", f"SLOW {TEXT}"),
                                              SpeechRequest("plain", TEXT)])
        started = time.monotonic()
        plain_result = await drain(plain)  # not held up by the stalled stream
        slow_result = await drain(slow)
        slow_s = time.monotonic() - started
        stall_task = asyncio.ensure_future(drain(stalled))
        await asyncio.sleep(0.3)
        assert not stall_task.done()
        engine.abort("stall")
        return plain_result, slow_result, slow_s, await stall_task

    plain, slow, slow_s, stalled = asyncio.run(run())
    assert plain == (3, None) and slow == (3, None)
    assert slow_s >= 3 * FAULTS["delay_s"]  # each of its chunks waited
    assert stalled[0] == 0 and stalled[1] is not None


def test_the_engine_queue_is_bounded(engine: PiperEngine) -> None:
    async def run():
        held = engine.submit([SpeechRequest(f"s{i}", f"STALL {TEXT}") for i in range(6)])
        with pytest.raises(EngineOverloadedError):
            engine.submit([SpeechRequest("one-too-many", TEXT)])
        for i in range(6):
            engine.abort(f"s{i}")
        await asyncio.gather(*(drain(it) for it in held))

    asyncio.run(run())


def test_crash_text_exits_the_process() -> None:
    code = ("import asyncio; from serve_app.engines.registry import create_engine\n"
            "from serve_app.engines.base import SpeechRequest\n"
            "e = create_engine('piper', {'intra_op_threads': 1, "
            "'fault_injection': {'crash_process_text': 'BOOM'}})\n"
            "async def run():\n"
            "    [it] = e.submit([SpeechRequest('x', 'BOOM. Two sentences here.')])\n"
            "    async for _ in it: pass\n"
            "asyncio.run(run())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert result.returncode == CRASH_EXIT_CODE, result.stderr[-2000:]
