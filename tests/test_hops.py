"""serve_app.hops.within: each item within its time limit, over a real event loop; a limit
missed ends the stream with StreamTimeout, and nothing else does. serve_app.hops.in_time: one
awaited answer within its limit, a cancellation never lost."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.hops import StreamTimeout, in_time, within


async def ticking(count: int, every_s: float = 0.0, log: list[str] | None = None):
    """``count`` items, ``every_s`` apart; then waits forever. Logs how its wait ended."""
    try:
        for index in range(count):
            await asyncio.sleep(every_s)
            yield index
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        if log is not None:
            log.append("cancelled")
        raise


def run(coroutine):
    return asyncio.run(coroutine)


def test_items_pass_in_order_and_the_stream_ends_with_them() -> None:
    async def items():
        for index in range(5):
            yield index

    async def main():
        return [item async for item in within(items(), 1.0, 1.0, 10.0)]

    assert run(main()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("before", [0, 3])
def test_a_late_item_ends_the_stream_and_cancels_the_wait_for_it(before: int) -> None:
    log: list[str] = []

    async def main():
        got = []
        with pytest.raises(StreamTimeout) as raised:
            async for item in within(ticking(before, log=log), 0.2, 0.1):
                got.append(item)
        return got, raised.value

    got, timeout = run(main())
    assert got == list(range(before)) and log == ["cancelled"]
    assert timeout.waited_s == (0.2 if before == 0 else 0.1) and not timeout.deadline


def test_the_time_the_caller_holds_an_item_is_not_the_streams() -> None:
    async def main():
        got = []
        async for item in within(ticking(4), 0.05, 0.05):
            got.append(item)
            await asyncio.sleep(0.15)  # longer than the limit, with the item in hand
            if len(got) == 4:
                return got

    assert run(main()) == [0, 1, 2, 3]


def test_the_whole_stream_is_cut_at_its_total_limit() -> None:
    async def main():
        with pytest.raises(StreamTimeout) as raised:
            async for _ in within(ticking(10_000, every_s=0.01), 5.0, 5.0, max_total_s=0.2):
                pass
        return raised.value

    timeout = run(main())
    assert timeout.deadline and timeout.waited_s == 0.2


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def main():
        async def read():
            async for _ in within(ticking(0), 5.0, 5.0):
                pass

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.05)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

    run(main())


def test_each_item_is_timed_in_the_task_that_asks_for_it() -> None:
    # as Starlette does: the first item read in the request's task, the rest in another
    async def main():
        stream = within(ticking(1), 0.1, 0.1)
        first = await anext(stream)
        await asyncio.sleep(0.3)  # this task goes on past the first wait's limit, untouched
        with pytest.raises(StreamTimeout):
            await asyncio.create_task(anext(stream))
        return first

    assert run(main()) == 0


def test_errors_of_the_items_pass_through() -> None:
    async def failing(error: BaseException):
        yield 1
        raise error

    async def main(error: BaseException):
        got = []
        with pytest.raises(type(error)) as raised:
            async for item in within(failing(error), 1.0, 1.0):
                got.append(item)
        return got, raised.type

    assert run(main(ValueError("bad"))) == ([1], ValueError)
    assert run(main(TimeoutError("its own"))) == ([1], TimeoutError)  # not a StreamTimeout


def test_in_time_gives_the_answer_or_times_out() -> None:
    async def main():
        answered = asyncio.get_running_loop().create_future()
        answered.set_result("fed")
        assert await in_time(answered, 1.0) == "fed"
        assert await in_time(answered, None) == "fed"
        with pytest.raises(TimeoutError):
            await in_time(asyncio.Event().wait(), 0.05)

    run(main())


def test_in_time_keeps_a_cancellation_that_comes_with_the_answer() -> None:
    # The lost WebSocket session (serve_app/front/speech_socket.py): the stream ended and the
    # session cancelled its text reader in the same loop pass as the reader's input_text.done
    # was answered. asyncio.wait_for on Python 3.11 returned the answer and dropped the cancel;
    # the reader then waited for a message forever, and response.done never left. Both happen
    # here in one synchronous block, so the order is fixed, not a matter of timing.
    async def main():
        answer = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(in_time(answer, 10.0))
        await asyncio.sleep(0)  # it runs up to its wait for the answer
        answer.set_result("fed")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    run(main())
