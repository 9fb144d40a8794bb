"""The synthesizer replica's side of the engine process (:mod:`serve_app.gpu.engine_process`).

:meth:`EngineClient.start` launches the engine in a child process and waits until it has loaded
and warmed up. After that every call is asynchronous and cheap for the replica: one reader thread
receives the engine's batched outputs and hands each batch to the event loop in one wake-up.

Each stream's chunks wait in an :class:`Inbox`. When the replica's loop falls behind, several
chunks of a stream are waiting by the time it reads them; they leave as one joined chunk, so a
busy replica relays fewer, larger items instead of falling further behind (nothing waits to be
joined: a lone chunk leaves at once).

If the engine process dies, every open stream ends with :class:`EngineDeadError`, new requests
are refused with it, :attr:`EngineClient.alive` turns False, and ``on_death`` is called (the
synthesizer then ends its own process, so Serve routes elsewhere and replaces it at once).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import numpy as np

from serve_app.engines.base import AudioChunk, EngineError, EngineStats, SpeechRequest
from serve_app.gpu import engine_wire
from serve_app.gpu.engine_protocol import (
    Abort,
    Call,
    Close,
    Outputs,
    Ready,
    Reply,
    Start,
    Stats,
    Submit,
)
from serve_app.messages import EngineInfo

logger = logging.getLogger(__name__)

# How long close() waits for the engine process to finish before killing it.
CLOSE_TIMEOUT_S = 30.0
# A step's outputs are megabytes (at 704 read streams on an H100, ~150 chunks of ~40 KB) and
# cross the socket a send buffer at a time. They used to cost the reader thread one read, and
# one wait of up to the GIL switch interval, per chunk and per buffer-full; engine_wire now
# reads a whole message in three calls (bench/engine/wire.py). Socket buffers asked for
# on both ends (Linux caps them at net.core.wmem_max / rmem_max, by default ~208 KiB): fewer
# trips through the kernel for a step's outputs where the limits allow.
SOCKET_BUFFER_BYTES = 8 << 20
# The shared memory a step's audio crosses in (engine_wire.AudioRing): ~10 busy steps' audio
# (a step at read 736 on an H100 is ~6 MB); a message that finds no room crosses the socket.
AUDIO_RING_BYTES = 64 << 20


class EngineDeadError(EngineError):
    """The engine process exited; its streams are gone and it takes no more requests."""


@dataclass
class Inbox:
    """One stream's items as they arrive from the engine process."""

    items: collections.deque = field(default_factory=collections.deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: object) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> AudioChunk:
        """The next chunk, joined with every chunk already waiting behind it; raises the
        exception that ended the stream."""
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        first = self.items.popleft()
        if isinstance(first, BaseException):
            raise first
        joined = [first]
        while (self.items and isinstance(self.items[0], AudioChunk) and not joined[-1].final
               and self.items[0].sample_rate_hz == first.sample_rate_hz):
            joined.append(self.items.popleft())
        return first if len(joined) == 1 else join_chunks(joined)


# A stream's first chunk carries the engine's own TTFB under one of these names (MiniCPM-o, Piper).
ENGINE_TTFB_TIMINGS = ("ttfb_s", "first_chunk_s")
# The clock readings a first chunk collects on its way back, in order. Not seconds, so not named
# ``*_s``: the front's stage histogram takes every ``*_s`` timing as a duration.
WAY_BACK_CLOCKS = ("clock_engine_sent", "clock_engine_sending", "clock_replica_received",
                   "clock_replica_dispatched")


def is_first_chunk(chunk: AudioChunk) -> bool:
    return not chunk.timings_s.keys().isdisjoint(ENGINE_TTFB_TIMINGS)


def stamp_way_back(chunk: AudioChunk, made_at_s: float, sending_at_s: float,
                   received_at_s: float) -> None:
    """Clock readings (``time.perf_counter``, one clock for every process of a host) of a first
    chunk's way to the replica (:data:`WAY_BACK_CLOCKS`): the engine process's sink took it,
    its sender thread began writing it, the replica's reader thread read it, the replica's
    event loop handed it to its inbox."""
    chunk.timings_s.update(zip(WAY_BACK_CLOCKS, (made_at_s, sending_at_s, received_at_s,
                                                 time.perf_counter())))


def join_chunks(chunks: list[AudioChunk]) -> AudioChunk:
    """Consecutive chunks of one stream as one: samples, text and words in order, every timing
    kept, the last one's usage (a final chunk's)."""
    timings: dict[str, float] = {}
    for chunk in chunks:
        timings.update(chunk.timings_s)
    return AudioChunk(chunks[0].request_id, np.concatenate([c.samples for c in chunks]),
                      chunks[0].sample_rate_hz, text="".join(c.text for c in chunks),
                      final=chunks[-1].final, timings_s=timings, usage=chunks[-1].usage,
                      words=tuple(word for chunk in chunks for word in chunk.words))


class EngineClient:
    """Talks to one engine process; :attr:`info` is what it reported about its engine when it
    was ready (name, model, sample rate, modes, what it can do, its slots)."""

    def __init__(self, process: subprocess.Popen, conn: socket.socket, info: EngineInfo,
                 on_death: Callable[[], None] | None = None,
                 ring: engine_wire.AudioRing | None = None) -> None:
        self._process = process
        self._on_death = on_death
        self._conn = conn
        self._ring = ring  # read by the reader thread only
        self.info = info
        self._stats = EngineStats(max_slots=info.max_slots)
        self._send_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._replies: dict[int, asyncio.Future] = {}
        self._inboxes: dict[str, Inbox] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDeadError | None = None
        self._closing = False
        self._reader = threading.Thread(target=self._read_forever, name="engine-client-reader",
                                        daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, engine: str, options: dict[str, Any],
              on_death: Callable[[], None] | None = None) -> "EngineClient":
        """Launch the engine process and wait until its engine is loaded and warm;
        ``on_death`` is called once if it later exits unasked (after its streams have failed)."""
        conn, theirs = socket.socketpair()
        for end in (conn, theirs):
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                end.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        sys.setswitchinterval(engine_wire.GIL_SWITCH_INTERVAL_S)  # this replica's process
        # shared memory needs a memfd (Linux); elsewhere the audio takes the socket
        ring = (engine_wire.AudioRing.create(AUDIO_RING_BYTES)
                if hasattr(os, "memfd_create") else None)
        ring_fds = [ring.fd] if ring is not None else []
        env = dict(os.environ)
        # The child imports serve_app from wherever this process found it.
        env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
        process = subprocess.Popen(
            [sys.executable, "-m", "serve_app.gpu.engine_process", str(theirs.fileno()),
             *([str(ring.fd), str(ring.capacity)] if ring is not None else [])],
            pass_fds=[theirs.fileno(), *ring_fds], env=env, close_fds=True)
        theirs.close()
        try:
            engine_wire.send_message(conn, Start(engine, dict(options)))
            message = engine_wire.receive(conn, ring)
        except (EOFError, OSError):
            message = None
        if not isinstance(message, Ready):
            if ring is not None:
                ring.close()
            code = process.wait()
            if message is None:
                raise RuntimeError(f"the engine process exited with code {code} while starting "
                                   "(its log is in this replica's stderr)")
            raise RuntimeError(f"engine {engine!r} failed to start: "
                               f"{getattr(message, 'message', message)}")
        logger.info("engine %s runs in process %d", engine, process.pid)
        return cls(process, conn, message.info, on_death, ring)

    # -- what the synthesizer calls ------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def pid(self) -> int:
        return self._process.pid

    def stats(self) -> EngineStats:
        """The engine's counters as last pushed (at most ~0.1 s old)."""
        return self._stats

    async def fresh_stats(self) -> EngineStats:
        """The engine's counters now."""
        self._stats = await self.call("stats")
        return self._stats

    async def submit(self, requests: list[SpeechRequest]
                     ) -> list[AsyncIterator[AudioChunk] | Exception]:
        """Submit together; each entry is that request's stream, or the exception that refused
        it (InvalidRequestError, EngineOverloadedError, EngineDeadError)."""
        if self._dead is not None:
            return [self._dead for _ in requests]
        self._bind_loop()
        for request in requests:
            self._inboxes[request.request_id] = Inbox()
        try:
            refusals = await self._ask(lambda call_id: Submit(call_id, requests))
        except BaseException:
            for request in requests:
                self._inboxes.pop(request.request_id, None)
            raise
        outcomes: list[AsyncIterator[AudioChunk] | Exception] = []
        for request, refusal in zip(requests, refusals):
            if refusal is None:
                outcomes.append(self._stream(request.request_id))
            else:
                self._inboxes.pop(request.request_id, None)
                outcomes.append(refusal)
        return outcomes

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._send(Abort(request_id))

    async def feed_text(self, request_id: str, delta: str, done: bool = False) -> None:
        await self.call("feed_text", request_id, delta, done)

    async def voices(self) -> list[str]:
        return await self.call("voices")

    async def call(self, method: str, *args: Any) -> Any:
        """Run the engine's ``method`` in the engine process; its exception is raised here."""
        return await self._ask(lambda call_id: Call(call_id, method, args))

    async def _ask(self, message_for: Callable[[int], Submit | Call]) -> Any:
        """Send the message ``message_for`` makes with a fresh call id; its Reply's value."""
        if self._dead is not None:
            raise self._dead
        loop = self._bind_loop()
        call_id = next(self._call_ids)
        future = loop.create_future()
        self._replies[call_id] = future
        message = message_for(call_id)
        try:
            if isinstance(message, Call) and message.slow:  # megabytes: off the event loop
                await asyncio.to_thread(self._send, message)
            else:
                self._send(message)
        except BaseException:
            self._replies.pop(call_id, None)
            raise
        return await future

    def close(self) -> None:
        """Let the engine finish and exit; kill it if it does not within CLOSE_TIMEOUT_S."""
        self._closing = True
        if self._dead is None:
            try:
                self._send(Close())
            except OSError:
                pass
        try:
            self._process.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not exit; killing it", self._process.pid)
            self._process.kill()
            self._process.wait()

    # -- internals ----------------------------------------------------------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._inboxes or self._replies:
                raise RuntimeError("EngineClient has streams or calls open on another event loop")
            self._loop = loop  # a replica keeps one loop; a script may run several in turn
        return loop

    def _send(self, message: Submit | Call | Abort | Close) -> None:
        encoded = engine_wire.encode(message)
        with self._send_lock:
            engine_wire.send(self._conn, encoded)

    async def _stream(self, request_id: str) -> AsyncIterator[AudioChunk]:
        inbox = self._inboxes[request_id]
        finished = False
        try:
            while True:
                try:
                    chunk = await inbox.take()
                except BaseException:
                    finished = True
                    raise
                yield chunk
                if chunk.final:
                    finished = True
                    return
        finally:
            self._inboxes.pop(request_id, None)
            if not finished:  # the caller stopped reading: free the engine's slot
                self.abort(request_id)

    def _read_forever(self) -> None:
        while True:
            try:
                message, sending_at_s = engine_wire.receive_timed(self._conn, self._ring)
            except (EOFError, OSError):
                break
            if isinstance(message, Stats):
                self._stats = message.stats
            elif self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, message, sending_at_s,
                                                time.perf_counter())
        if self._ring is not None:
            self._ring.close()
        code = self._process.wait()
        dead = EngineDeadError(f"the engine process exited with code {code}")
        if not self._closing:
            logger.error("%s; failing its streams", dead)
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._fail_all, dead)
                return
            except RuntimeError:  # the loop closed meanwhile
                pass
        self._dead = dead
        if not self._closing and self._on_death is not None:
            self._on_death()

    def _dispatch(self, message: object, sending_at_s: float = 0.0,
                  received_at_s: float = 0.0) -> None:
        if isinstance(message, Outputs):
            for request_id, item in message.items:
                inbox = self._inboxes.get(request_id)
                if inbox is not None:  # else its caller is gone
                    if isinstance(item, AudioChunk) and is_first_chunk(item):
                        stamp_way_back(item, message.made_at_s, sending_at_s, received_at_s)
                    inbox.put(item)
        elif isinstance(message, Reply):
            future = self._replies.pop(message.call_id, None)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.value)
                else:
                    future.set_exception(message.error)
        else:
            logger.error("unknown message from the engine: %s", type(message).__name__)

    def _fail_all(self, dead: EngineDeadError) -> None:
        self._dead = dead
        for inbox in self._inboxes.values():
            inbox.put(dead)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(dead)
        self._replies.clear()
        if not self._closing and self._on_death is not None:
            self._on_death()
