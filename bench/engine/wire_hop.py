#!/usr/bin/env python3
"""The engine -> replica hop of ``python -m bench.engine.wire``, both sides: run by path in a fresh
process whose ``PYTHONPATH`` starts with the measured tree, so it imports whatever ``serve_app``
that tree has and nothing else of this checkout (an older tree has no ``bench/``).

``--measure-once SETTINGS`` is the Synthesizer replica: the real
:class:`~serve_app.gpu.engine_client.EngineClient` (its reader thread, its dispatch into
per-stream inboxes), each stream read by a task of its own that relays it as the Synthesizer
does, within its timeouts (``serve_app.hops.within``), and "ships" every chunk onward as Serve
would (``cloudpickle.dumps``); it prints the run's figures as one JSON line. Its child,
``--engine-side``, is the engine process: the real
:class:`~serve_app.gpu.engine_process.EngineServer` serving :class:`StepEngine`, a stand-in
whose step thread hands the sink one step's outputs every ``step_period_s``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import pickle
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
SAMPLE_RATE_HZ = 24_000


def thread_cpu_s(thread: threading.Thread | None) -> float:
    """CPU seconds ``thread`` has used so far (Linux: any thread's clock can be read)."""
    if thread is None or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError):
        return 0.0


def wire_end(fd: int):
    """The object the measured tree's engine_wire reads and writes, over ``fd``: a
    multiprocessing Connection before the wire framed its own messages, else the socket."""
    from serve_app.gpu import engine_wire

    end = next(iter(inspect.signature(engine_wire.receive).parameters.values()))
    if "Connection" in str(end.annotation):
        return Connection(fd)
    return socket.socket(fileno=fd)


def minor_faults() -> int:
    """Page faults this process took without I/O (fresh memory touched for the first time)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def named_thread(name: str) -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == name), None)


def _busy_until(deadline_s: float) -> None:
    """Hold the step thread busy until ``deadline_s`` as a GPU engine's step thread is: Python
    work with the GIL, let go for a moment at each device call (here every ~20 us)."""
    work: dict[int, int] = {}
    while time.perf_counter() < deadline_s:
        for index in range(200):
            work[index] = work.get(index, 0) + index
        time.sleep(0)


class StepEngine:
    """A stand-in engine: once every expected stream is submitted, its step thread delivers
    ``steps`` steps of outputs to the streams' sink, one call per step (as ``Outbox.deliver``),
    then a last step that ends every stream still open with an empty final chunk."""

    sample_rate_hz = SAMPLE_RATE_HZ
    modes = ("read",)
    clones_voices = False

    def __init__(self, settings: dict[str, Any], report_path: str) -> None:
        from serve_app.engines.base import EngineStats

        self._settings = settings
        self._report_path = report_path
        self._stats = EngineStats(max_slots=settings["streams"])
        self._sink = None
        self._open: list[str] = []
        self._sink_cpu_s = 0.0
        self._steps_done = 0
        rng = np.random.default_rng(0)
        low, high = int(settings["samples"] * 0.9), int(settings["samples"] * 1.1)
        self._sizes = [int(n) for n in rng.integers(low, high, 997)]
        # The decoder's audio: a distinct array per chunk (views of one long signal, so making
        # them costs nothing; pickle would send one array twice only once)
        self._audio = rng.uniform(-0.5, 0.5, 4 * high * settings["chunks"]).astype(np.float32)
        self._audio_at = 0
        self._stepper: threading.Thread | None = None
        self._started_s = self._finished_s = 0.0
        self._cpu_at_start: dict[str, float] = {}

    def submit_to(self, requests, sink) -> None:
        self._sink = sink
        self._open.extend(request.request_id for request in requests)
        if len(self._open) == self._settings["streams"] and self._stepper is None:
            self._stepper = threading.Thread(target=self._run_steps, name="engine-step")
            self._stepper.start()

    def _cpu_now(self) -> dict[str, float]:
        return {"process": time.process_time(), "minor_faults": minor_faults(),
                "sender_thread": thread_cpu_s(named_thread("engine-sender"))}

    def _run_steps(self) -> None:
        from serve_app.engines.base import AudioChunk, RequestAbortedError
        from serve_app.engines.usage import StreamUsage

        settings = self._settings
        next_s = time.perf_counter()
        cursor = 0
        for step in range(settings["warmup_steps"] + settings["steps"]):
            if step == settings["warmup_steps"]:  # measured from here on
                self._cpu_at_start = self._cpu_now()
                self._started_s = time.perf_counter()
                self._sink_cpu_s, self._steps_done = 0.0, 0
            next_s += settings["step_period_s"]
            items: list[tuple[str, object]] = []
            chunks = min(settings["chunks"], len(self._open))
            for index in range(chunks):
                request_id = self._open[(cursor + index) % len(self._open)]
                marked = index in (0, chunks - 1)  # the step's first and last chunk are timed
                timings = ({"ttfb_s": 0.01 * (index + 1), "bench_step": float(step)} if marked
                           else {})
                items.append((request_id, AudioChunk(
                    request_id, self._samples(step * chunks + index), SAMPLE_RATE_HZ,
                    text="a few words " if index % 3 == 0 else "", timings_s=timings)))
            cursor += chunks
            for _ in range(settings["finals_per_step"]):
                request_id = self._open.pop(cursor % len(self._open))
                items.append((request_id, AudioChunk(
                    request_id, self._samples(step)[:2000], SAMPLE_RATE_HZ, final=True,
                    timings_s={"total_s": 10.0, "tts_steps": 750.0},
                    usage=StreamUsage(40, 750))))
            for _ in range(settings["errors_per_step"]):
                request_id = self._open.pop(cursor % len(self._open))
                items.append((request_id, RequestAbortedError(f"{request_id} aborted")))
            self._deliver(items)
            if settings.get("busy_step"):
                _busy_until(next_s)
            time.sleep(max(0.0, next_s - time.perf_counter()))
        self._deliver([(request_id, AudioChunk(request_id, np.zeros(0, np.float32),
                                               SAMPLE_RATE_HZ, final=True,
                                               usage=StreamUsage(40, 750)))
                       for request_id in self._open])
        self._open.clear()
        self._finished_s = time.perf_counter()

    def _samples(self, index: int) -> np.ndarray:
        size = self._sizes[index % len(self._sizes)]
        if self._audio_at + size > len(self._audio):
            self._audio_at = 0
        self._audio_at += size
        return self._audio[self._audio_at - size:self._audio_at]

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        cpu_s = time.thread_time()
        self._sink(items)
        self._sink_cpu_s += time.thread_time() - cpu_s
        self._steps_done += 1

    def close(self) -> None:
        cpu = self._cpu_now()
        Path(self._report_path).write_text(json.dumps({
            "steps": self._steps_done,
            "steps_wall_s": self._finished_s - self._started_s,
            "step_thread_sink_cpu_s": self._sink_cpu_s,
            "sender_thread_cpu_s": cpu["sender_thread"] - self._cpu_at_start["sender_thread"],
            "process_cpu_s": cpu["process"] - self._cpu_at_start["process"],
            "minor_faults": cpu["minor_faults"] - self._cpu_at_start["minor_faults"],
        }))

    def abort(self, request_id: str) -> None:
        pass

    def feed_text(self, request_id: str, delta: str, done: bool = False) -> None:
        pass

    def voices(self) -> list[str]:
        return ["default"]

    def stats(self):
        return self._stats


def engine_side(fd: int, settings_json: str, report_path: str, ring_args: list[str]) -> None:
    """Run as the engine process: the real EngineServer over the stand-in engine (with the
    replica's audio ring, ``ring_args`` = [fd, bytes], where the measured tree has one)."""
    from serve_app.gpu import engine_wire
    from serve_app.gpu.engine_process import EngineServer, engine_info
    from serve_app.gpu.engine_protocol import Start

    sys.setswitchinterval(engine_wire.GIL_SWITCH_INTERVAL_S)
    conn = wire_end(fd)
    start = engine_wire.receive(conn)
    assert isinstance(start, Start), start
    engine = StepEngine(json.loads(settings_json), report_path)
    server = (EngineServer(engine, conn, engine_wire.AudioRing(*map(int, ring_args)))
              if ring_args else EngineServer(engine, conn))
    server.run(engine_info(engine, "bench-steps"))


def start_client(settings: dict[str, Any], report_path: str):
    """The real EngineClient over a child running :func:`engine_side` (as EngineClient.start,
    with this script as the child)."""
    from serve_app.gpu import engine_client, engine_wire
    from serve_app.gpu.engine_client import EngineClient
    from serve_app.gpu.engine_protocol import Ready, Start

    ours, theirs = socket.socketpair()
    for end in (ours, theirs):
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            end.setsockopt(socket.SOL_SOCKET, option, engine_client.SOCKET_BUFFER_BYTES)
    sys.setswitchinterval(engine_wire.GIL_SWITCH_INTERVAL_S)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path[1:] if p))
    # the shared memory the audio crosses in, as EngineClient.start makes it (newer trees)
    ring = (engine_wire.AudioRing.create(engine_client.AUDIO_RING_BYTES)
            if hasattr(engine_wire, "AudioRing") else None)
    ring_args = [str(ring.fd), str(ring.capacity)] if ring is not None else []
    process = subprocess.Popen(
        [sys.executable, __file__, "--engine-side", str(theirs.fileno()), json.dumps(settings),
         report_path, *ring_args],
        pass_fds=[theirs.fileno()] + ([ring.fd] if ring is not None else []), env=env,
        close_fds=True)
    theirs.close()
    conn = wire_end(ours.detach())
    engine_wire.send_message(conn, Start("bench-steps", {}))
    ready = engine_wire.receive(conn)
    assert isinstance(ready, Ready), ready
    if ring is None:
        return EngineClient(process, conn, ready.info)
    return EngineClient(process, conn, ready.info, None, ring)


def onward(how: str = "serve"):
    """What Serve does with each item a replica yields (its default response serialization);
    ``how="none"``: nothing, to see the relay's own cost."""
    if how == "none":
        return (lambda item: b""), "none"
    try:
        from ray import cloudpickle
        return cloudpickle.dumps, "ray.cloudpickle.dumps"
    except ImportError:
        return (lambda item: pickle.dumps(item, protocol=5)), "pickle.dumps (protocol 5)"


async def read_streams(client, settings: dict[str, Any]) -> dict[str, Any]:
    from serve_app.engines.base import RequestAbortedError, SpeechRequest
    from serve_app.hops import within

    ship, _ = onward(settings["onward"])
    marks: list[tuple[float, float, float, float]] = []
    shipped = {"items": 0, "bytes": 0, "ended_by_error": 0}

    start: dict[str, float] = {}

    def measure_from_here() -> None:
        start.update(loop=time.thread_time(), process=time.process_time(),
                     reader=thread_cpu_s(client._reader), faults=minor_faults())

    async def read(stream) -> None:
        try:
            relayed = stream if settings["onward"] == "none" else within(stream, 60.0, 30.0)
            async for chunk in relayed:
                read_at_s = time.perf_counter()
                shipped["bytes"] += len(ship(chunk))
                shipped["items"] += 1
                timings = chunk.timings_s
                if timings.get("bench_step", -1) >= settings["warmup_steps"]:
                    if not start:
                        measure_from_here()
                    marks.append((timings["clock_engine_sent"], timings["clock_replica_received"],
                                  timings["clock_replica_dispatched"], read_at_s))
        except RequestAbortedError:
            shipped["ended_by_error"] += 1

    requests = [SpeechRequest(f"s{index}", "x") for index in range(settings["streams"])]
    streams = await client.submit(requests)
    await asyncio.gather(*(read(stream) for stream in streams))
    return {
        "loop_thread_cpu_s": time.thread_time() - start["loop"],
        "reader_thread_cpu_s": thread_cpu_s(client._reader) - start["reader"],
        "process_cpu_s": time.process_time() - start["process"],
        "minor_faults": minor_faults() - start["faults"],
        "marks": marks, **shipped,
    }


def percentiles_ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.5) * 1000, 3), "p90": round(pick(0.9) * 1000, 3),
            "p99": round(pick(0.99) * 1000, 3), "max": round(ordered[-1] * 1000, 3)}


def measure(settings: dict[str, Any]) -> dict[str, Any]:
    """One run against the importable serve_app."""
    import serve_app

    with tempfile.TemporaryDirectory() as folder:
        report_path = os.path.join(folder, "engine.json")
        client = start_client(settings, report_path)
        try:
            replica = asyncio.run(read_streams(client, settings))
        finally:
            client.close()
        engine = json.loads(Path(report_path).read_text())
    steps = engine["steps"]
    per_step = lambda seconds: round(seconds * 1000 / steps, 3)  # noqa: E731
    marks = replica.pop("marks")
    return {
        "serve_app": str(Path(serve_app.__file__).parent.parent),
        "steps": steps,
        "cpu_ms_per_step": {
            "engine_step_thread_sink": per_step(engine["step_thread_sink_cpu_s"]),
            "engine_sender_thread": per_step(engine["sender_thread_cpu_s"]),
            "engine_process": per_step(engine["process_cpu_s"]),
            "replica_reader_thread": per_step(replica["reader_thread_cpu_s"]),
            "replica_loop_thread": per_step(replica["loop_thread_cpu_s"]),
            "replica_process": per_step(replica["process_cpu_s"]),
        },
        "minor_page_faults_per_step": {
            "engine_process": round(engine["minor_faults"] / steps, 1),
            "replica_process": round(replica["minor_faults"] / steps, 1)},
        # share of one core over the steps' wall time (the replica's 40-54 % on the H100)
        "replica_process_core_share": round(replica["process_cpu_s"] / engine["steps_wall_s"], 3),
        "engine_process_core_share": round(engine["process_cpu_s"] / engine["steps_wall_s"], 3),
        "wall_ms": {
            "engine_to_reader": percentiles_ms([m[1] - m[0] for m in marks]),
            "engine_to_dispatched": percentiles_ms([m[2] - m[0] for m in marks]),
            "engine_to_stream_reader": percentiles_ms([m[3] - m[0] for m in marks]),
        },
        "items_shipped": replica["items"], "bytes_shipped": replica["bytes"],
        "streams_ended_by_error": replica["ended_by_error"],
    }


def main() -> None:
    """As a child: ``--engine-side`` (the engine process) or ``--measure-once`` (one run, its
    figures printed as one JSON line)."""
    if len(sys.argv) > 1 and sys.argv[1] == "--engine-side":
        engine_side(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--measure-once":
        print(json.dumps(measure(json.loads(sys.argv[2]))), flush=True)
if __name__ == "__main__":
    main()
