"""The engine in its own process (serve_app.gpu.engine_process) and the replica's side of it
(serve_app.gpu.engine_client), with the real Piper engine and no Ray."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from serve_app.engines.base import AudioChunk, EngineError, InvalidRequestError, SpeechRequest
from serve_app.engines.registry import create_engine
from serve_app.gpu import engine_wire
from serve_app.gpu.engine_client import EngineClient, EngineDeadError, Inbox
from serve_app.gpu.engine_process import EngineServer
from serve_app.messages import StreamUsage

ROOT = Path(__file__).resolve().parents[2]
CRASH = "CRASH-NOW"
TEXT = "The engine runs in a process of its own. Its chunks come back over a socket."


@pytest.fixture(scope="module")
def client() -> EngineClient:
    engine = EngineClient.start("piper", {"intra_op_threads": 1, "first_piece_phonemes": 40})
    yield engine
    engine.close()


async def collect(stream) -> list[AudioChunk]:
    return [chunk async for chunk in stream]


def test_streams_and_refusals_cross_the_process(client: EngineClient) -> None:
    async def run():
        ok, empty, fast = await client.submit([
            SpeechRequest("ok-1", TEXT), SpeechRequest("bad-1", "\x00"),
            SpeechRequest("bad-2", TEXT, speed=9.0)])
        chunks = await collect(ok)
        stats = await client.fresh_stats()
        return empty, fast, chunks, stats

    empty, fast, chunks, stats = asyncio.run(run())
    # Refusals keep their field and code across the process boundary; the good request runs.
    assert isinstance(empty, InvalidRequestError) and empty.param == "text"
    assert isinstance(fast, InvalidRequestError) and fast.param == "speed"
    samples = sum(len(c.samples) for c in chunks)
    assert chunks[-1].final and samples > 0.5 * client.info.sample_rate_hz
    assert chunks[0].timings_s  # the engine's per-stage timings travel with the chunk
    assert stats.completed >= 1 and stats.active_streams == 0
    # The final chunk carries the stream's usage: Piper counts characters, a token per 20 ms.
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage == StreamUsage(input_tokens=len(TEXT),
                                           output_tokens=-(-samples // (22_050 // 50)))


def test_the_engine_reports_itself_and_answers_calls(client: EngineClient) -> None:
    async def run():
        with pytest.raises(EngineError, match="no call"):
            await client.call("warmup")
        return await client.voices()

    assert asyncio.run(run()) == client.info.voices
    assert client.info.engine == "piper" and client.info.max_slots > 0
    assert not client.info.clones_voices and not client.info.follows_instructions


def test_a_reader_that_falls_behind_gets_the_waiting_chunks_joined(client: EngineClient) -> None:
    request = SpeechRequest("late", TEXT * 3, seed=1, word_times=True)

    async def in_process() -> list[AudioChunk]:  # the same engine, read chunk by chunk
        engine = create_engine("piper", {"intra_op_threads": 1, "first_piece_phonemes": 40})
        try:
            (stream,) = engine.submit([request])
            return await collect(stream)
        finally:
            engine.close()

    async def late_reader() -> list[AudioChunk]:
        completed = (await client.fresh_stats()).completed
        (stream,) = await client.submit([request])
        first = await anext(stream)
        # The replica's loop is busy until the engine has finished the whole stream.
        deadline = time.monotonic() + 120
        while client.stats().completed == completed:
            assert time.monotonic() < deadline, "the engine never finished"
            time.sleep(0.05)
        return [first] + await collect(stream)

    chunks = asyncio.run(in_process())
    late = asyncio.run(late_reader())
    assert len(chunks) >= 3
    # Everything that waited left as one chunk: the same audio and text, in two items.
    assert len(late) == 2 and late[-1].final and not late[0].final
    assert late[-1].usage == chunks[-1].usage  # the joined final chunk keeps the usage
    np.testing.assert_array_equal(np.concatenate([c.samples for c in late]),
                                  np.concatenate([c.samples for c in chunks]))
    assert "".join(c.text for c in late) == "".join(c.text for c in chunks)
    words = [word for c in chunks for word in c.words]
    assert words and [word for c in late for word in c.words] == words  # and the words


def test_inbox_never_joins_past_a_final_chunk_or_an_error() -> None:
    def chunk(n: int, final: bool = False) -> AudioChunk:
        return AudioChunk("x", np.full(n, n, np.float32), 24000, text=str(n), final=final,
                          timings_s={f"t{n}": float(n)})

    async def run():
        inbox = Inbox()
        for item in (chunk(1), chunk(2), chunk(3, final=True), chunk(4)):
            inbox.put(item)
        joined = await inbox.take()
        after = await inbox.take()
        inbox.put(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError):
            await inbox.take()
        return joined, after

    joined, after = asyncio.run(run())
    assert joined.final and joined.text == "123" and len(joined.samples) == 6
    assert joined.timings_s == {"t1": 1.0, "t2": 2.0, "t3": 3.0}
    assert after.text == "4"


def test_a_dead_engine_process_ends_its_streams_and_refuses_new_ones() -> None:
    engine = EngineClient.start("piper", {"intra_op_threads": 1, "first_piece_phonemes": 40,
                                          "fault_injection": {"crash_process_text": CRASH}})
    try:
        async def run():
            (stream,) = await engine.submit([SpeechRequest("c", f"{CRASH} {TEXT * 3}")])
            with pytest.raises(EngineDeadError):
                await collect(stream)
            return await engine.submit([SpeechRequest("after", TEXT)])

        (refused,) = asyncio.run(run())
        assert isinstance(refused, EngineDeadError)
        assert not engine.alive
    finally:
        engine.close()


def test_the_engine_process_exits_when_its_replica_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "replica.py"
    script.write_text(
        "import sys, time\n"
        "from serve_app.gpu.engine_client import EngineClient\n"
        "engine = EngineClient.start('piper', {'intra_op_threads': 1})\n"
        "print(engine.pid, flush=True)\n"
        "time.sleep(600)\n")
    replica = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        engine_pid = int(replica.stdout.readline())
        replica.send_signal(signal.SIGKILL)  # no cleanup runs in the replica
        replica.wait()
        deadline = time.monotonic() + 120
        while Path(f"/proc/{engine_pid}").exists() and _state(engine_pid) != "Z":
            assert time.monotonic() < deadline, "the engine process outlived its replica"
            time.sleep(0.2)
    finally:
        replica.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_an_output_item_that_cannot_be_sent_ends_only_its_own_stream() -> None:
    engine = create_engine("piper", {"intra_op_threads": 1})
    writer, reader = socket.socketpair()
    try:
        server = EngineServer(engine, writer)
        good = AudioChunk("good", np.ones(480, np.float32), 24_000, text="fine")
        # a chunk whose timings hold something pickle refuses
        bad = AudioChunk("bad", np.ones(480, np.float32), 24_000, timings_s={"x": lambda: 0.0})
        server._send_out([("good", good), ("bad", bad)])
        received = []
        while not server._sends.empty():
            engine_wire.send(writer, server._sends.get())
            received.extend(engine_wire.receive(reader).items)
    finally:
        engine.close()
    items = dict(received)
    np.testing.assert_array_equal(items["good"].samples, good.samples)
    assert isinstance(items["bad"], EngineError) and "could not be sent" in str(items["bad"])
