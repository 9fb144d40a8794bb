"""The engine process's wire (serve_app.gpu.engine_wire): a step's outputs, errors, finals and
the replies between replica and engine cross a real socket pair as they were sent, each chunk
with samples of its own."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
from ray import cloudpickle

from serve_app.engines.base import AudioChunk, InvalidRequestError, RequestAbortedError
from serve_app.engines.words import WordTime
from serve_app.gpu import engine_wire
from serve_app.gpu.engine_protocol import Call, Outputs, Reply
from serve_app.messages import StreamUsage
from tests.own_process import call_in_own_process

RATE_HZ = 24_000


def across(*messages: object) -> list[object]:
    """``messages`` sent from one end of a socket pair (in a thread of their own: a step's
    megabytes do not fit the socket's buffer) and received at the other."""
    writer, reader = socket.socketpair()
    with writer, reader:
        sending = threading.Thread(
            target=lambda: [engine_wire.send_message(writer, m) for m in messages])
        sending.start()
        received = [engine_wire.receive(reader) for _ in messages]
        sending.join()
    return received


def a_step(chunks: int = 150, seed: int = 0) -> list[tuple[str, object]]:
    """A busy step's outputs: chunks of 9-11 k samples (some empty), finals with usage and
    errors mixed in, in the order the engine made them."""
    rng = np.random.default_rng(seed)
    items: list[tuple[str, object]] = []
    for index in range(chunks):
        request_id = f"s{index}"
        if index % 50 == 7:
            items.append((request_id, RequestAbortedError(f"{request_id} aborted")))
        elif index % 25 == 3:
            items.append((request_id, AudioChunk(
                request_id, rng.uniform(-1, 1, int(rng.integers(0, 3))).astype(np.float32),
                RATE_HZ, final=True, timings_s={"total_s": 9.5}, usage=StreamUsage(40, index))))
        else:
            size = 0 if index % 40 == 5 else int(rng.integers(9_000, 11_000))
            items.append((request_id, AudioChunk(
                request_id, rng.uniform(-1, 1, size).astype(np.float32), RATE_HZ,
                text="words " * (index % 3), timings_s={"ttfb_s": 0.02} if index < 4 else {},
                words=tuple(WordTime("words", index + n / 3, index + (n + 1) / 3)
                            for n in range(index % 3)))))
    return items


def assert_same_items(received: list, sent: list) -> None:
    assert [request_id for request_id, _ in received] == [request_id for request_id, _ in sent]
    for (_, got), (_, want) in zip(received, sent):
        assert type(got) is type(want)
        if isinstance(want, AudioChunk):
            assert got.samples.dtype == np.float32
            np.testing.assert_array_equal(got.samples, want.samples)
            assert (got.request_id, got.sample_rate_hz, got.text, got.final, got.timings_s,
                    got.usage, got.words) == (want.request_id, want.sample_rate_hz, want.text,
                                              want.final, want.timings_s, want.usage, want.words)
        else:
            assert str(got) == str(want)


def test_a_busy_step_crosses_whole_and_in_order() -> None:
    sent = a_step()
    encoded = engine_wire.encode(Outputs(sent, made_at_s=12.5))
    # the ~6 MB of audio travels beside the pickle, never copied into it
    assert len(encoded.header) < 20_000
    (received,) = across(Outputs(sent, made_at_s=12.5))
    assert isinstance(received, Outputs) and received.made_at_s == 12.5
    assert_same_items(received.items, sent)


def test_messages_follow_one_another_on_one_socket() -> None:
    steps = [a_step(chunks, seed) for seed, chunks in enumerate((3, 600, 0, 40))]
    messages = [Reply(1, value=["default"]), *(Outputs(step) for step in steps),
                Call(2, "feed_text", ("s1", "more text", False)),
                Reply(3, error=InvalidRequestError("no", "text"))]
    received = across(*messages)
    assert received[0] == messages[0] and received[-2] == messages[-2]
    for got, step in zip(received[1:-2], steps):  # 600 chunks: more buffers than one sendmsg takes
        assert_same_items(got.items, step)
    assert isinstance(received[-1].error, InvalidRequestError) and received[-1].error.param == "text"


def test_each_chunk_owns_its_samples() -> None:
    sent = a_step(60)
    (received,) = across(Outputs(sent))
    chunks = [item for _, item in received.items if isinstance(item, AudioChunk)]
    # writable, and writing one stream's samples changes no other stream's
    assert all(chunk.samples.flags.writeable for chunk in chunks)
    for chunk in chunks:
        chunk.samples[:] = 7.0
    for (_, got), (_, want) in zip(received.items, sent):
        if isinstance(want, AudioChunk):
            assert (got.samples == 7.0).all() and len(got.samples) == len(want.samples)
    kept = next(chunk for chunk in chunks if len(chunk.samples) > 1000)
    original = next(item for request_id, item in sent if request_id == kept.request_id)
    np.testing.assert_array_equal(kept.samples, 7.0)
    kept.samples[:] = original.samples
    # the other streams are consumed and gone: the kept stream's chunk still holds its audio
    del received, chunks, chunk
    gc.collect()
    np.testing.assert_array_equal(kept.samples, original.samples)


def bytes_of_a_kept_chunk() -> tuple[int, int, int]:
    """Traced bytes after a step of 150 streams crossed, then after all but one chunk were let
    go, and that chunk's samples' bytes (run by the test below in a process of its own)."""
    sent = a_step(150)
    tracemalloc.start()
    try:
        (received,) = across(Outputs(sent))
        step_bytes = tracemalloc.get_traced_memory()[0]
        kept = next(item for _, item in received.items
                    if isinstance(item, AudioChunk) and len(item.samples) > 1000)
        del received
        gc.collect()
        held_bytes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return step_bytes, held_bytes, kept.samples.nbytes


def test_a_chunk_kept_keeps_only_its_own_samples() -> None:
    # tracemalloc runs in a process of its own (tests/own_process.py says why)
    step_bytes, held_bytes, kept_bytes = call_in_own_process(
        "tests.serving.test_engine_wire", "bytes_of_a_kept_chunk")
    # a replica that keeps one stream's chunk (a reader waiting for its next one) holds that
    # chunk's samples, not the whole step's audio
    assert step_bytes > 5_000_000 and held_bytes < kept_bytes + 500_000


def test_a_closed_socket_ends_the_reader() -> None:
    writer, reader = socket.socketpair()
    with reader:
        engine_wire.send_message(writer, Reply(1, value=2))
        writer.close()
        assert engine_wire.receive(reader) == Reply(1, value=2)
        with pytest.raises(EOFError):
            engine_wire.receive(reader)


@pytest.mark.parametrize("dumps", [
    lambda chunk: pickle.dumps(chunk, protocol=2), lambda chunk: pickle.dumps(chunk, protocol=4),
    lambda chunk: pickle.dumps(chunk, protocol=5), cloudpickle.dumps])
def test_a_chunk_pickles_whole_at_any_protocol(dumps) -> None:
    samples = np.linspace(-1, 1, 1001, dtype=np.float32)
    for chunk in (AudioChunk("a", samples, RATE_HZ, text="hi", final=True,
                             timings_s={"ttfb_s": 0.1}, usage=StreamUsage(3, 4),
                             words=(WordTime("hi", 0.01, 0.02),)),
                  AudioChunk("b", samples[::2], RATE_HZ),  # a strided view
                  AudioChunk("c", samples.astype(np.float64), RATE_HZ)):  # float32 on the way
        back = pickle.loads(dumps(chunk))
        assert back.samples.dtype == np.float32 and back.samples.flags.writeable
        np.testing.assert_array_equal(back.samples, chunk.samples.astype(np.float32))
        assert (back.request_id, back.text, back.final, back.timings_s, back.usage,
                back.words) == (chunk.request_id, chunk.text, chunk.final, chunk.timings_s,
                                chunk.usage, chunk.words)


def test_a_deep_copied_chunk_has_samples_of_its_own() -> None:
    chunk = AudioChunk("a", np.ones(10, np.float32), RATE_HZ)
    copied = copy.deepcopy(chunk)
    copied.samples[:] = 0
    assert (chunk.samples == 1).all()


def test_a_frame_carries_when_its_sender_began_writing_it() -> None:
    """The receiver learns when the write began (the sender's clock, one clock for the host's
    processes), not when the message was made: the time a message waits for its sender shows
    apart from the time it takes to cross."""
    encoded = engine_wire.encode(Outputs(a_step(3), made_at_s=1.0))
    time.sleep(0.05)  # the message waits before its sender takes it
    writer, reader = socket.socketpair()
    with writer, reader:
        before_s = time.perf_counter()
        engine_wire.send(writer, encoded)
        after_s = time.perf_counter()
        message, sending_at_s = engine_wire.receive_timed(reader)
    assert isinstance(message, Outputs) and message.made_at_s == 1.0
    assert before_s <= sending_at_s <= after_s


def across_ring(ring_bytes: int, *messages: object) -> tuple[list[object], int]:
    """``messages`` sent through a socket pair and an AudioRing of ``ring_bytes`` and read at
    the other end; and the bytes the reader took from the ring."""
    writer, reader = socket.socketpair()
    ring = engine_wire.AudioRing.create(ring_bytes)
    # the reader's mapping of the same memory, as the replica's is (the fd crosses processes)
    reader_ring = engine_wire.AudioRing(os.dup(ring.fd), ring_bytes)
    received = []
    with writer, reader:
        for message in messages:  # one at a time: each finds room, only its head on the socket
            engine_wire.send(writer, engine_wire.encode(message), ring)
            received.append(engine_wire.receive(reader, reader_ring))
    carried = reader_ring.bytes_taken
    ring.close()
    reader_ring.close()
    return received, carried


def step_bytes(items: list[tuple[str, object]]) -> int:
    return sum(item.samples.nbytes for _, item in items if isinstance(item, AudioChunk))


def test_a_step_crosses_in_the_ring_whole_and_each_chunk_owns_its_samples() -> None:
    sent = a_step()
    (received,), carried = across_ring(32 << 20, Outputs(sent, made_at_s=3.0))
    assert isinstance(received, Outputs) and received.made_at_s == 3.0
    assert_same_items(received.items, sent)
    assert carried == step_bytes(sent)  # the audio went through the ring, not the socket
    chunks = [item for _, item in received.items if isinstance(item, AudioChunk)]
    assert all(chunk.samples.flags.writeable and chunk.samples.base is not None
               for chunk in chunks if len(chunk.samples))
    for chunk in chunks:  # copies of their own: writing one changes no other
        chunk.samples[:] = 5.0
    assert all((got.samples == 5.0).all() for _, got in received.items
               if isinstance(got, AudioChunk))


def test_steps_wrap_around_the_ring_in_order() -> None:
    steps = [a_step(12, seed) for seed in range(30)]  # ~0.5 MB each through a 2 MB ring
    received, carried = across_ring(2 << 20, *(Outputs(step) for step in steps))
    for got, step in zip(received, steps):
        assert_same_items(got.items, step)
    # each message starts where it fits whole; what a wrap skips counts as taken too
    assert carried >= sum(step_bytes(step) for step in steps)


def test_a_step_that_finds_the_ring_full_crosses_the_socket() -> None:
    """The sender never waits for the reader and never overwrites what it has not read: a step
    sent while the ring still holds an unread one, with too little room beside it, goes through
    the socket, and both arrive whole and in order."""
    first, second = a_step(40, 0), a_step(2, 1)  # ~1.4 MB, then ~80 KB (fits a socket buffer)
    room = step_bytes(first) + 50_000  # the second does not fit beside the first
    writer, reader = socket.socketpair()
    ring = engine_wire.AudioRing.create(room)
    reader_ring = engine_wire.AudioRing(os.dup(ring.fd), room)
    with writer, reader:
        engine_wire.send(writer, engine_wire.encode(Outputs(first)), ring)
        engine_wire.send(writer, engine_wire.encode(Outputs(second)), ring)
        received = [engine_wire.receive(reader, reader_ring) for _ in range(2)]
    assert_same_items(received[0].items, first)
    assert_same_items(received[1].items, second)
    assert reader_ring.bytes_taken == step_bytes(first)  # only the first used the ring
    # once the first is read, there is room again
    assert ring.put([memoryview(np.zeros(60_000, np.uint8))]) is not None
    ring.close()
    reader_ring.close()
