"""The engine in a process of its own, answering the synthesizer replica over a socket pair.

A Serve replica's process is busy with more than the engine: its event loop relays every chunk,
Ray pickles each streamed item, the metrics pusher and the handle machinery run there too. All
of it shares one GIL with the engine's step thread, and at a GPU's full load that starved the
step thread (docs/benchmarks/served-h100.json: the synthesizer process at 90-100 % of a core).
vLLM splits its API server from its EngineCore process for the same reason. Here the replica
keeps the Ray and HTTP side (:mod:`serve_app.gpu.engine_client`), and this process keeps the engine:
its step thread competes only with this module's two small threads and its event loop, and no
chunk passes through that loop: the engine hands each step's output to the sender thread.

Messages are the dataclasses of :mod:`serve_app.gpu.engine_protocol` (their audio out of band:
:mod:`serve_app.gpu.engine_wire`).

Outputs are sent in batches: the engine delivers everything one step produced in one call
(``Engine.submit_to``'s sink), which becomes one :class:`~serve_app.gpu.engine_protocol.Outputs`
message, so a busy step costs one write, not one per stream. The step thread pickles it (the
chunks' fields, not their audio: the buffers stay out of band) and the sender thread writes it
in one call, straight from the arrays and without the GIL; no other thread here holds the GIL
for long while streams run, so the step thread never waits long to get it back after a GPU
sync. A closed socket means the replica is gone: this process exits at once (the GPU memory
goes with it).

Run as ``python -m serve_app.gpu.engine_process FD [RING_FD RING_BYTES]`` by
:class:`~serve_app.gpu.engine_client.EngineClient` (the socket, and the shared memory of
:class:`~serve_app.gpu.engine_wire.AudioRing`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

from serve_app.engines.base import (
    AudioChunk,
    Engine,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    OutputSink,
    SpeechRequest,
)
from serve_app.engines.registry import create_engine
from serve_app.gpu import engine_wire
from serve_app.gpu.engine_protocol import (
    Abort,
    Call,
    Close,
    Failed,
    Outputs,
    Ready,
    Reply,
    Start,
    Stats,
    Submit,
)
from serve_app.messages import EngineInfo

logger = logging.getLogger("serve_app.gpu.engine_process")

# How often changed engine counters are pushed to the replica (its metrics read them).
STATS_INTERVAL_S = 0.1


# A submission read this long before its answer was queued is logged (engine log).
SLOW_SUBMISSION_S = 0.02


def engine_info(engine: Engine, name: str) -> EngineInfo:
    """What the replica needs to know about the engine without asking each time."""
    return EngineInfo(
        engine=name, model_id=getattr(engine, "model_id", name),
        sample_rate_hz=engine.sample_rate_hz, voices=list(engine.voices()),
        modes=list(engine.modes), benchmark=getattr(engine, "benchmark", None),
        clones_voices=getattr(engine, "clones_voices", False),
        follows_instructions=getattr(engine, "follows_instructions", False),
        times_words=getattr(engine, "times_words", False),
        max_slots=engine.stats().max_slots)


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else an EngineError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return EngineError(f"{type(exc).__name__}: {exc}")


def submit_each(engine: Engine, requests: list[SpeechRequest], sink: OutputSink
                ) -> list[InvalidRequestError | EngineOverloadedError | None]:
    """Submit ``requests`` one by one, each admitted or refused alone, so one bad request
    never sinks the others and one that does not fit takes none with it (a batch taken all or
    none, then again one by one, did each request's work twice). Per request: None
    (admitted), or the exception that refused it."""
    outcomes: list[InvalidRequestError | EngineOverloadedError | None] = []
    for request in requests:
        try:
            engine.submit_to([request], sink)
            outcomes.append(None)
        except (InvalidRequestError, EngineOverloadedError) as exc:
            outcomes.append(exc)
    return outcomes


class EngineServer:
    """Serves one engine to one replica until told to close or the replica is gone."""

    def __init__(self, engine: Engine, conn: socket.socket,
                 ring: engine_wire.AudioRing | None = None) -> None:
        self._engine = engine
        self._conn = conn
        self._ring = ring  # written by the sender thread only
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[str, Callable[..., Any]] = {
            "feed_text": engine.feed_text,
            "stats": engine.stats,
            "voices": engine.voices,
        }
        for method in ("embed_voice", "add_voice", "remove_voice", "step_phase_seconds"):
            if hasattr(engine, method):
                self._calls[method] = getattr(engine, method)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed: asyncio.Event | None = None

    def run(self, info: EngineInfo) -> None:
        sender = threading.Thread(target=self._send_forever, name="engine-sender", daemon=True)
        sender.start()
        self._put(Ready(info))
        asyncio.run(self._serve())
        self._engine.close()
        self._sends.put(None)  # after everything queued before it
        sender.join(timeout=10)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        threading.Thread(target=self._read_forever, name="engine-reader", daemon=True).start()
        stats_task = self._loop.create_task(self._push_stats())
        await self._closed.wait()
        stats_task.cancel()

    def _read_forever(self) -> None:
        assert self._loop is not None
        while True:
            try:
                message = engine_wire.receive(self._conn)
            except (EOFError, OSError):
                # The replica is gone (killed, crashed): nobody is left to serve.
                logger.warning("replica closed the connection; engine process exits")
                os._exit(0)
            self._loop.call_soon_threadsafe(self._handle, message, time.perf_counter())
            if isinstance(message, Close):
                return

    def _send_forever(self) -> None:
        while True:
            message = self._sends.get()
            if message is None:
                return
            try:
                engine_wire.send(self._conn, message, self._ring)
            except (BrokenPipeError, OSError):
                os._exit(0)

    def _put(self, message: object) -> None:
        """Pickle ``message`` here (its audio stays out of band); the sender thread writes it."""
        self._sends.put(engine_wire.encode(message))

    def _handle(self, message: object, received_s: float = 0.0) -> None:
        if isinstance(message, Abort):
            self._engine.abort(message.request_id)
        elif isinstance(message, Submit):
            handled_s = time.perf_counter()
            self._answer(message.call_id, self._submit, (message.requests,))
            done_s = time.perf_counter()
            if done_s - received_s > SLOW_SUBMISSION_S:  # where a slow answer's time went
                logger.info("slow submission: requests=%d loop_wait_ms=%.1f handled_ms=%.1f",
                            len(message.requests), (handled_s - received_s) * 1000,
                            (done_s - handled_s) * 1000)
        elif isinstance(message, Call):
            method = self._calls.get(message.method)
            if method is None:
                self._put(Reply(message.call_id, error=EngineError(
                    f"the engine has no call {message.method!r}")))
            elif message.slow:
                assert self._loop is not None
                self._loop.create_task(asyncio.to_thread(
                    self._answer, message.call_id, method, message.args))
            else:
                self._answer(message.call_id, method, message.args)
        elif isinstance(message, Close):
            assert self._closed is not None
            self._closed.set()
        else:
            logger.error("unknown message from the replica: %s", type(message).__name__)

    def _submit(self, requests: list[SpeechRequest]) -> list[BaseException | None]:
        """Admit ``requests`` (their output goes straight to the sender); per request, None or
        the exception that refused it."""
        return [None if refusal is None else portable(refusal)
                for refusal in submit_each(self._engine, requests, self._send_out)]

    def _send_out(self, items: list[tuple[str, object]]) -> None:
        """The engine's output sink (called from its step thread): one message per delivery,
        pickled here, written by the sender thread."""
        made_at_s = time.perf_counter()
        out = [(request_id, item if isinstance(item, AudioChunk) else portable(item))
               for request_id, item in items]
        try:
            self._put(Outputs(out, made_at_s))
        except Exception:  # one item that cannot be sent ends its own stream, not the others
            logger.exception("could not pickle a step's output; sending it item by item")
            for request_id, item in out:
                try:
                    self._put(Outputs([(request_id, item)], made_at_s))
                except Exception as exc:
                    self._put(Outputs([(request_id, EngineError(
                        f"the engine's output could not be sent: {type(exc).__name__}"))],
                        made_at_s))

    def _answer(self, call_id: int, method: Callable[..., Any], args: tuple) -> None:
        try:
            self._put(Reply(call_id, value=method(*args)))
        except BaseException as exc:  # the caller gets it; the engine goes on
            self._put(Reply(call_id, error=portable(exc)))

    async def _push_stats(self) -> None:
        last = None
        while True:
            stats = self._engine.stats()
            if stats != last:
                self._put(Stats(stats))
                last = stats
            await asyncio.sleep(STATS_INTERVAL_S)


def main() -> None:
    conn = socket.socket(fileno=int(sys.argv[1]))
    # the shared memory its outputs' audio crosses in, when the replica made one
    ring = (engine_wire.AudioRing(int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3
            else None)
    # the step thread gives up the GIL at every GPU sync and must get it back at once
    sys.setswitchinterval(engine_wire.GIL_SWITCH_INTERVAL_S)
    logging.basicConfig(
        level=os.environ.get("SERVE_APP_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s engine-process[{os.getpid()}] %(name)s: %(message)s")
    start = engine_wire.receive(conn)
    assert isinstance(start, Start), start
    try:
        engine = create_engine(start.engine, start.options)
        engine.warmup()
    except BaseException as exc:
        logger.exception("engine %s failed to start", start.engine)
        engine_wire.send_message(
            conn, Failed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    # what the step thread's host work runs with (Ray sets OMP_NUM_THREADS to num_cpus)
    logger.info("engine process ready: cpus=%d usable_cpus=%d OMP_NUM_THREADS=%s "
                "torch_threads=%s", os.cpu_count() or 0, len(os.sched_getaffinity(0)),
                os.environ.get("OMP_NUM_THREADS", "-"), _torch_threads())
    EngineServer(engine, conn, ring).run(engine_info(engine, start.engine))


def _torch_threads() -> str:
    torch = sys.modules.get("torch")  # only an engine that uses PyTorch has loaded it
    return str(torch.get_num_threads()) if torch is not None else "-"

if __name__ == "__main__":
    main()
