"""What the engine contract's tests (tests/engines/test_engine_contract*.py) share: the engines
they run over, requests with fixed lengths, and ways to read a stream or a sink without hanging.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from serve_app.engines.base import AudioChunk, LengthControls, SpeechRequest
from serve_app.engines.registry import create_engine
from tests.engines.minicpmo.tiny_engine import tiny_engine
from tests.engines.streams import drain

HANG_GUARD_S = 120.0  # a stream that should speak and does not fails here instead of hanging
FRAMES = LengthControls(audio_frames=80)  # MiniCPM-o's random weights: several chunks; Piper: n/a
TWO_SENTENCES = "Hello from the serving stack. This second sentence is a little longer."
# An open input that can be spoken at once: a sentence end and well over ten TTS tokens.
SPEAKABLE_START = "Hello from a streamed request. And this clause is not"
_ids = itertools.count()


def contract_engines():
    """A module-scoped pytest fixture, parametrized over the engines: MiniCPM-o on the tiny
    checkpoint and Piper, each closed after the module (``engine = contract_engines()``)."""

    @pytest.fixture(scope="module", params=["minicpmo", "piper"])
    def engine(request):
        if request.param == "minicpmo":
            engine = tiny_engine(request.getfixturevalue("tiny_checkpoint"), max_slots=3,
                                 max_chat_slots=1)
        else:
            engine = create_engine("piper", {"intra_op_threads": 2, "max_batch_size": 4,
                                             "admission": "slots"})
        yield engine
        engine.close()

    return engine


def rid(name: str) -> str:
    """A request id no other test on the module's engine uses."""
    return f"{name}-{next(_ids)}"


def whole(request_id: str, text: str = TWO_SENTENCES, **fields) -> SpeechRequest:
    return SpeechRequest(request_id, text, seed=1, lengths=FRAMES, **fields)


def streamed(request_id: str, text: str = "", **fields) -> SpeechRequest:
    # A cap, not a fixed length: MiniCPM-o cuts text that stops at a break only in a segment
    # that can end; 5 s is past Piper's first clause, so its first chunk is not cut to final.
    fields.setdefault("max_audio_s", 5.0)
    return SpeechRequest(request_id, text, seed=1, text_input="streamed", **fields)


async def chunks_of(stream) -> list[AudioChunk]:
    return [chunk async for chunk in stream]


def audio(chunks: list[AudioChunk]) -> np.ndarray:
    return np.concatenate([chunk.samples for chunk in chunks])


def spoken_alone(engine, request: SpeechRequest) -> np.ndarray:
    async def run():
        (stream,) = engine.submit([request])
        return audio(await chunks_of(stream))

    return asyncio.run(run())


def assert_quiet(engine) -> None:
    stats = engine.stats()
    assert (stats.active_streams, stats.queued_streams) == (0, 0)


class Sink:
    """An output sink (Engine.submit_to) that keeps every item; awaitable until streams end."""

    def __init__(self) -> None:
        self.items: list[tuple[str, object]] = []
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()

    def __call__(self, items: list[tuple[str, object]]) -> None:  # any thread
        self.items.extend(items)
        self._loop.call_soon_threadsafe(self._changed.set)

    def of(self, request_id: str) -> list[object]:
        return [item for r, item in list(self.items) if r == request_id]

    def ended(self, request_id: str) -> bool:
        items = self.of(request_id)
        return bool(items) and (isinstance(items[-1], BaseException) or items[-1].final)

    async def wait_until(self, condition) -> None:
        async def wait() -> None:
            while not condition():
                self._changed.clear()
                if condition():  # items that came before the clear
                    return
                await self._changed.wait()

        await asyncio.wait_for(wait(), HANG_GUARD_S)

    async def wait_ended(self, *request_ids: str) -> None:
        await self.wait_until(lambda: all(self.ended(r) for r in request_ids))


async def first_chunk(stream) -> AudioChunk:
    return await asyncio.wait_for(anext(stream), HANG_GUARD_S)


async def drain_guarded(stream) -> tuple[int, BaseException | None]:
    """drain, for a stream that ends only if the engine ends it (an open input)"""
    return await asyncio.wait_for(drain(stream), HANG_GUARD_S)
