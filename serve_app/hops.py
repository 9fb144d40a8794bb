"""What every hop (synthesizer, ingress) does with the stream it relays: wait for each item
within a time limit, say which limit was missed, and tell a hang-up from a failure.

Each hop waits :data:`HOP_MARGIN_S` longer than the one below it, so the innermost timeout fires
first and names the real cause.

A client that leaves cancels its request, and Serve cancels the calls that request made: the
cancellation then surfaces as ``asyncio.CancelledError`` or as Ray's own ``TaskCancelledError``
(Serve's ``RequestCancelledError`` is one), depending on where the hop was waiting.
:func:`is_cancellation` tells them apart from failures; a hop raises them on as
``asyncio.CancelledError`` (:func:`as_cancellation`), so that nothing above counts a hang-up as a
server error.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, AsyncIterator, Awaitable, TypeVar

from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import BackPressureError

from serve_app import errors
from serve_app.errors import ApiError

Item = TypeVar("Item")

HOP_MARGIN_S = 5.0
CANCELLATIONS = (asyncio.CancelledError, TaskCancelledError)


def is_cancellation(exc: BaseException) -> bool:
    """``exc`` says the request was cancelled (its client left), not that something failed; a
    group of exceptions (a task group's) when each of them says so."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_cancellation(inner) for inner in exc.exceptions)
    return isinstance(exc, CANCELLATIONS)


def as_cancellation(exc: BaseException) -> asyncio.CancelledError:
    """The ``asyncio.CancelledError`` to raise (``from exc``) for a hang-up that surfaced as
    another exception."""
    return asyncio.CancelledError(f"{type(exc).__name__}: {exc}")


async def in_time(awaitable: Awaitable[Any], timeout_s: float | None) -> Any:
    """``await awaitable`` within ``timeout_s`` (None: no limit), else ``TimeoutError``, in the
    calling task; a cancellation of that task is always raised, even when the awaitable's result
    came in the same loop pass.

    ``asyncio.wait_for`` on Python 3.11 drops such a cancellation and returns the result (CPython
    gh-86296, fixed in 3.12). A WebSocket session lost its end to it: the stream ended and the
    session cancelled its text reader just as the reader's ``input_text.done`` was answered; the
    reader went on waiting for a message the client never sends, so ``response.done`` never left
    (1 of 13 sessions, ``serve_config.cpu.yaml``, 3-4 sessions at once)."""
    async with asyncio.timeout(timeout_s):
        return await awaitable


class StreamTimeout(TimeoutError):
    """No item within the limit; ``waited_s`` is that limit, ``deadline`` says it was the
    stream's wall-clock cap rather than the wait for one item."""

    def __init__(self, waited_s: float, deadline: bool = False) -> None:
        super().__init__(f"nothing for {waited_s:.1f} s" if not deadline
                         else f"stream cut at its {waited_s:g} s limit")
        self.waited_s = waited_s
        self.deadline = deadline


class _Watchdog:
    """The timer of one stream in :func:`within`: armed once for a wait and moved only when it
    fires early, rather than a timer made and cancelled for every item (``asyncio.timeout``,
    ~10 us an item, hundreds of items a step at each hop). When it fires while its stream
    waits past the deadline, it cancels the waiting task, as ``asyncio.timeout`` does."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task: asyncio.Task | None = None
        self._deadline: float | None = None  # loop time the current wait ends; None: no wait
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for = math.inf
        self.expired = False

    def wait_until(self, deadline: float, task: asyncio.Task) -> None:
        self._deadline, self._task = deadline, task
        if deadline < self._armed_for:
            if self._handle is not None:
                self._handle.cancel()
            self._arm(deadline)

    def stop_waiting(self) -> None:
        self._deadline = None

    def take_back_expiry(self) -> bool:
        """Whether it cancelled the task since it was last asked (and forget it)."""
        expired, self.expired = self.expired, False
        return expired

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle, self._armed_for = None, math.inf

    def _arm(self, deadline: float) -> None:
        self._handle = self._loop.call_at(deadline, self._fire)
        self._armed_for = deadline

    def _fire(self) -> None:
        armed_for, self._handle, self._armed_for = self._armed_for, None, math.inf
        if self._deadline is None:
            return  # between waits: the next wait arms it again
        if self._deadline <= armed_for:
            self.expired = True
            assert self._task is not None
            self._task.cancel()
        else:
            self._arm(self._deadline)  # the wait it was armed for ended; this one ends later


async def within(items: AsyncIterator[Item], first_timeout_s: float, next_timeout_s: float,
                 max_total_s: float | None = None) -> AsyncIterator[Item]:
    """``items``, the first within ``first_timeout_s``, each later one within
    ``next_timeout_s``, all within ``max_total_s`` of the call; raises :class:`StreamTimeout`.

    Errors of ``items`` pass through. Closing this iterator does not close ``items``: the hop
    that owns the upstream stream cancels it (and so frees the engine slot) itself.

    Each item is awaited in the task that asks for it (not in a task of its own, as
    ``wait_for`` does on Python 3.11): a cancellation reaches ``items`` directly, and whatever
    ``items`` raises then is raised here, never left in a task nobody reads ("Task exception was
    never retrieved", as Serve's stream raises ``RequestCancelledError`` when cancelled). A
    timeout cancels that task while it waits for ``items`` (never while the caller has the item)
    and becomes :class:`StreamTimeout` here, as ``asyncio.timeout`` would; a cancellation from
    elsewhere stays one.
    """
    loop = asyncio.get_running_loop()
    started_s = loop.time()
    watchdog = _Watchdog(loop)
    timeout_s = first_timeout_s
    try:
        while True:
            deadline = False
            if max_total_s is not None:
                remaining_s = max_total_s - (loop.time() - started_s)
                if remaining_s <= 0:
                    raise StreamTimeout(max_total_s, deadline=True)
                if remaining_s < timeout_s:
                    timeout_s, deadline = remaining_s, True
            task = asyncio.current_task()
            assert task is not None
            cancelling = task.cancelling()
            watchdog.wait_until(loop.time() + timeout_s, task)
            try:
                item = await anext(items)
            except BaseException as exc:
                # the watchdog's cancel is taken back whatever ended the wait, as
                # asyncio.timeout does; only a cancellation it alone asked for is a timeout
                if (watchdog.take_back_expiry() and task.uncancel() <= cancelling
                        and isinstance(exc, asyncio.CancelledError)):
                    raise StreamTimeout(max_total_s if deadline else timeout_s,
                                        deadline) from None
                if isinstance(exc, StopAsyncIteration):
                    return
                raise
            finally:
                watchdog.stop_waiting()
            if watchdog.take_back_expiry():  # cancelled, yet ``items`` gave an item
                task.uncancel()
            yield item
            timeout_s = next_timeout_s
    finally:
        watchdog.close()


def relay_error(request_id: str, below: str, exc: BaseException) -> ApiError:
    """What a hop answers when the stream from the hop ``below`` it failed with ``exc``."""
    if isinstance(exc, BackPressureError):
        return errors.overloaded()
    if isinstance(exc, StreamTimeout):
        return errors.timed_out(request_id, below, exc.waited_s)
    if isinstance(exc, ApiError):
        return exc
    # A dead replica below (RayActorError) lands here too; Serve restarts it.
    return errors.synthesis_unavailable(request_id, exc)
