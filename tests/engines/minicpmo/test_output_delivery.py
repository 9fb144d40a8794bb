"""How the MiniCPM-o engine hands its output over (tiny checkpoint, CPU): a step's chunks for
all its streams leave together, in one call per sink (Engine.submit_to), and Engine.submit's
iterators read exactly the same audio."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from serve_app.engines.base import AudioChunk, LengthControls, SpeechRequest
from tests.engines.minicpmo.tiny_engine import tiny_engine

TEXT = "Every stream of this step leaves in one delivery. " * 2
FRAMES = LengthControls(audio_frames=60)  # random tiny weights never stop by themselves
IDS = ("one", "two", "three")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = tiny_engine(tiny_checkpoint, max_slots=4, max_chat_slots=2)
    yield engine
    engine.close()


class RecordingSink:
    """A sink that keeps every delivery (called from the engine's step thread)."""

    def __init__(self, expected_ends: int) -> None:
        self.deliveries: list[list[tuple[str, object]]] = []
        self._ends_left = expected_ends
        self.ended = threading.Event()

    def __call__(self, items: list[tuple[str, object]]) -> None:
        self.deliveries.append(list(items))
        for _, item in items:
            if isinstance(item, BaseException) or item.final:
                self._ends_left -= 1
        if self._ends_left <= 0:
            self.ended.set()

    def items_of(self, request_id: str) -> list[object]:
        return [item for batch in self.deliveries for rid, item in batch if rid == request_id]


def requests(suffix: str) -> list[SpeechRequest]:
    return [SpeechRequest(f"{name}-{suffix}", TEXT, seed=7, lengths=FRAMES) for name in IDS]


def test_a_steps_chunks_for_every_stream_leave_in_one_delivery(engine) -> None:
    sink = RecordingSink(expected_ends=len(IDS))
    engine.submit_to(requests("sink"), sink)
    assert sink.ended.wait(timeout=300)

    per_stream = {name: sink.items_of(f"{name}-sink") for name in IDS}
    for items in per_stream.values():
        assert all(isinstance(item, AudioChunk) for item in items)
        assert [item.final for item in items] == [False] * (len(items) - 1) + [True]
        assert len(items) >= 3
    # Streams admitted together advance together: their chunks share deliveries rather than
    # waking the reader once per chunk.
    assert any(len({rid for rid, _ in batch}) == len(IDS) for batch in sink.deliveries)
    assert len(sink.deliveries) < sum(len(items) for items in per_stream.values())

    async def through_iterators() -> list[np.ndarray]:
        streams = engine.submit(requests("iter"))

        async def audio(stream) -> np.ndarray:
            return np.concatenate([chunk.samples async for chunk in stream])

        return list(await asyncio.gather(*(audio(s) for s in streams)))

    for name, iterated in zip(IDS, asyncio.run(through_iterators())):
        delivered = np.concatenate([item.samples for item in per_stream[name]])
        np.testing.assert_array_equal(delivered, iterated)


def test_a_chunk_after_its_listener_played_all_it_had_is_counted_as_ran_dry() -> None:
    from serve_app.engines.base import Outbox
    from serve_app.engines.minicpmo.output import emit
    from serve_app.engines.minicpmo.scheduler import Stream, StreamPlan

    outbox = Outbox()
    stream = Stream(StreamPlan(SpeechRequest("dry", TEXT), prompt="", pieces=[TEXT]),
                    sink=lambda items: None, submitted_at=0.0)
    tenth_of_a_second = np.zeros(2400, dtype=np.float32)
    emit(outbox, stream, tenth_of_a_second)  # the first audio: nothing played yet
    emit(outbox, stream, tenth_of_a_second)  # 0.1 s still to play: on time
    assert outbox.take_ran_dry() == 0
    stream.played_out_at -= 1.0  # the listener played it all a while ago
    emit(outbox, stream, tenth_of_a_second)
    emit(outbox, stream, np.zeros(0, dtype=np.float32))  # nothing sent, nothing counted
    assert outbox.take_ran_dry() == 1
    assert outbox.take_ran_dry() == 0  # taken once
