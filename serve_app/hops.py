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
import time
from typing import AsyncIterator, TypeVar

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


class StreamTimeout(TimeoutError):
    """No item within the limit; ``waited_s`` is that limit, ``deadline`` says it was the
    stream's wall-clock cap rather than the wait for one item."""

    def __init__(self, waited_s: float, deadline: bool = False) -> None:
        super().__init__(f"nothing for {waited_s:.1f} s" if not deadline
                         else f"stream cut at its {waited_s:g} s limit")
        self.waited_s = waited_s
        self.deadline = deadline


async def within(items: AsyncIterator[Item], first_timeout_s: float, next_timeout_s: float,
                 max_total_s: float | None = None) -> AsyncIterator[Item]:
    """``items``, the first within ``first_timeout_s``, each later one within
    ``next_timeout_s``, all within ``max_total_s`` of the call; raises :class:`StreamTimeout`.

    Errors of ``items`` pass through. Closing this iterator does not close ``items``: the hop
    that owns the upstream stream cancels it (and so frees the engine slot) itself.

    Each item is awaited in the caller's own task (``asyncio.timeout``, not ``wait_for``, which
    on Python 3.11 runs it in a task of its own): a cancellation reaches ``items`` directly, and
    whatever ``items`` raises then is raised here, never left in a task nobody reads ("Task
    exception was never retrieved", as Serve's stream raises ``RequestCancelledError`` when
    cancelled).
    """
    started_s = time.monotonic()
    timeout_s = first_timeout_s
    while True:
        deadline = False
        if max_total_s is not None:
            remaining_s = max_total_s - (time.monotonic() - started_s)
            if remaining_s <= 0:
                raise StreamTimeout(max_total_s, deadline=True)
            if remaining_s < timeout_s:
                timeout_s, deadline = remaining_s, True
        limit = asyncio.timeout(timeout_s)
        try:
            async with limit:
                item = await anext(items)
        except StopAsyncIteration:
            return
        except TimeoutError:
            if not limit.expired():
                raise  # raised by items itself
            raise StreamTimeout(max_total_s if deadline else timeout_s, deadline) from None
        yield item
        timeout_s = next_timeout_s


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
