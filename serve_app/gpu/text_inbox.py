"""The way a WebSocket session's text reaches the Synthesizer replica that holds its stream.

A session's stream is one Serve call, ``Synthesizer.synthesize``, and takes one of the replica's
``max_ongoing_requests`` while it runs; its text comes later, a delta at a time. Were each delta
a Serve call of its own, a replica full of streams would refuse it (every slot is a stream
waiting for text), and so would a draining replica, which must still finish its open sessions.
So the text never goes through Serve: each replica starts a :class:`TextInbox`, a small Ray
actor of its own, and a streamed-input stream announces it
(:class:`~serve_app.messages.TextInputOpen`). The front calls ``TextInbox.put`` on it, a plain
actor call that neither Serve's capacity nor its draining sees, and the replica's
:class:`InboxReader` takes what arrived (a long poll), feeds it to the engine and answers each
``put``: None, or the engine's refusal as an :class:`~serve_app.errors.ApiError`; a failure to
feed the text raises at the caller.

Order: a session sends its next text only once its last ``put`` has been answered, and the
reader hands the engine each batch in the order it arrived. The inbox belongs to the replica's
process: when the replica dies, so does the inbox, and a ``put`` raises (``ActorDiedError``).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import TaskCancelledError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.engines.base import InvalidRequestError
from serve_app.errors import ApiError
from serve_app.gpu.admission import refused
from serve_app.gpu.engine_client import EngineClient, EngineDeadError

logger = logging.getLogger(__name__)

# Calls the inbox runs at once: every session of the replica may wait in ``put`` (one each).
INBOX_CONCURRENCY = 65536


@dataclass(frozen=True)
class TextDelta:
    """Text for the streamed-input request ``request_id``; ``done``: its input ends here."""

    ticket: int
    request_id: str
    delta: str
    done: bool


@dataclass(frozen=True)
class NotFed:
    """The replica failed to feed the text to its engine (not a refusal): ``put`` raises."""

    reason: str


Outcome = ApiError | NotFed | None


@ray.remote(num_cpus=0, max_concurrency=INBOX_CONCURRENCY, max_restarts=0)
class TextInbox:
    """One replica's inbox: ``put`` (the front) waits until the replica has fed the text to its
    engine; ``take`` and ``answer`` are the replica's."""

    def __init__(self) -> None:
        self._waiting: list[TextDelta] = []
        self._arrived = asyncio.Event()
        self._answers: dict[int, asyncio.Future] = {}
        self._tickets = itertools.count()

    async def put(self, request_id: str, delta: str, done: bool = False) -> ApiError | None:
        """Feed ``delta`` to the stream (``done``: its input ends); None, or the engine's
        refusal; raises if the replica failed to feed it."""
        ticket = next(self._tickets)
        answer = asyncio.get_running_loop().create_future()
        self._answers[ticket] = answer
        self._waiting.append(TextDelta(ticket, request_id, delta, done))
        self._arrived.set()
        try:
            outcome = await answer
        finally:
            self._answers.pop(ticket, None)
        if isinstance(outcome, NotFed):
            raise RuntimeError(outcome.reason)
        return outcome

    async def take(self) -> list[TextDelta]:
        """Everything put since the last take, in order; waits for something to arrive."""
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        taken, self._waiting = self._waiting, []
        return taken

    async def answer(self, answers: list[tuple[int, Outcome]]) -> None:
        for ticket, outcome in answers:
            future = self._answers.get(ticket)
            if future is not None and not future.done():
                future.set_result(outcome)


def start_inbox() -> Any:
    """A new TextInbox on this node (a handle), owned by this process: it dies with it."""
    node = ray.get_runtime_context().get_node_id()
    return TextInbox.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()


class InboxReader:
    """The replica's side: takes its inbox's text and feeds it to the engine, answering each
    ``put``. :meth:`start` on the event loop that runs the engine's streams."""

    def __init__(self, inbox: Any, engine: EngineClient) -> None:
        self.inbox = inbox
        self._engine = engine
        self._reading: asyncio.Task | None = None
        self._feeding: set[asyncio.Task] = set()
        self._answers: list[tuple[int, Outcome]] = []
        self.failure: BaseException | None = None

    @property
    def alive(self) -> bool:
        """False once the inbox is gone (the replica then takes no more text)."""
        return self.failure is None

    def start(self) -> None:
        """Start reading (once). The reader runs in a context of its own: started from within
        a request, its calls would count as that request's children (an async actor keeps the
        current task in a context variable), and Ray cancels those when the request is
        cancelled, as when a client hangs up."""
        if self._reading is None:
            self._reading = asyncio.get_running_loop().create_task(
                self._read_forever(), context=contextvars.Context())

    def stop(self) -> None:
        if self._reading is not None:
            self._reading.cancel()

    async def _read_forever(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    taken = await self.inbox.take.remote()
                except TaskCancelledError:  # the call was cancelled, not the inbox: ask again
                    logger.warning("a take from the text inbox was cancelled; taking again")
                    await asyncio.sleep(0.1)
                    continue
                for item in taken:
                    # Each task sends its text to the engine process before its first wait,
                    # and tasks start in the order they were made: the engine gets the batch
                    # in order.
                    task = loop.create_task(self._feed(item))
                    self._feeding.add(task)
                    task.add_done_callback(self._feeding.discard)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the inbox is gone: the health check fails, Serve replaces us
            self.failure = exc
            logger.error("the text inbox is gone (%s); streams here get no more text",
                         type(exc).__name__)

    async def _feed(self, item: TextDelta) -> None:
        outcome: Outcome = None
        try:
            await self._engine.feed_text(item.request_id, item.delta, item.done)
        except (InvalidRequestError, EngineDeadError) as exc:
            outcome = refused(item.request_id, exc)
        except Exception as exc:
            logger.error("request %s: text not fed to the engine (%s)", item.request_id,
                         type(exc).__name__)
            outcome = NotFed(f"the text was not fed to the engine: {type(exc).__name__}")
        self._answers.append((item.ticket, outcome))
        if len(self._answers) == 1:  # one answer call for all that finish in this loop pass
            asyncio.get_running_loop().call_soon(self._send_answers)

    def _send_answers(self) -> None:
        answers, self._answers = self._answers, []
        self.inbox.answer.remote(answers)
