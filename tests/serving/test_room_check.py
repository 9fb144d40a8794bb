"""The Synthesizer replica's room check (serve_app/gpu/room_check.py): the engine's last
pushed stats, less the streams let through since, decide at once; new stats start the count
again. Real EngineStats as the engine's scheduler makes them."""

from __future__ import annotations

import time

from serve_app.engines.stats import EngineStats
from serve_app.gpu.room_check import PASS_WINDOW_S, RoomCheck


def stats(read_room: float, chat_room: float, active: int = 10, free_slots: int = 500,
          limit: float = 0.65) -> EngineStats:
    """Stats of an engine with room for ``read_room`` read or ``chat_room`` chat streams."""
    read_cost, chat_cost = 0.001, 0.004
    load = limit - read_room * read_cost
    made = EngineStats(active_streams=active, max_slots=1024, work_limit=limit, work_load=load,
                       read_stream_load=read_cost, chat_stream_load=chat_cost,
                       free_slots=free_slots)
    assert abs(made.work_room("chat") - chat_room) < 1e-9  # a chat stream: four read streams
    return made


def test_streams_let_through_since_the_last_stats_use_up_their_room():
    check = RoomCheck()
    pushed = stats(read_room=3.0, chat_room=0.75)
    assert [check.refusal(pushed, "read") for _ in range(4)] == [None, None, None, "work"]
    # the next push has the engine's own count of them: the check starts again from it
    assert check.refusal(stats(read_room=2.0, chat_room=0.5), "read") is None


def test_a_chat_stream_uses_the_room_of_several_read_streams():
    check = RoomCheck()
    pushed = stats(read_room=8.0, chat_room=2.0)
    assert check.refusal(pushed, "chat") is None  # 4 read streams' worth of work
    assert [check.refusal(pushed, "read") for _ in range(5)] == [None, None, None, None, "work"]
    assert check.refusal(pushed, "chat") == "work"


def test_free_slots_bound_the_room_and_name_the_reason():
    check = RoomCheck()
    pushed = stats(read_room=50.0, chat_room=12.5, free_slots=1)
    assert check.refusal(pushed, "read") is None
    assert check.refusal(pushed, "read") == "slots"


def test_an_idle_engine_and_admission_by_slots_take_what_comes():
    check = RoomCheck()
    idle = stats(read_room=0.0, chat_room=0.0, active=0)  # a model that learned a slow spell
    assert all(check.refusal(idle, "read") is None for _ in range(20))
    by_slots = EngineStats(active_streams=900, max_slots=1024)  # work_limit 0: its queue decides
    assert all(check.refusal(by_slots, "chat") is None for _ in range(20))


def test_a_stream_let_through_counts_only_for_a_few_pushes():
    """The engine pushes only when its stats change, and late on a loaded machine: a stream
    that passed long ago is in its figures by then, so it no longer counts."""
    check = RoomCheck()
    pushed = stats(read_room=2.0, chat_room=0.5)
    assert [check.refusal(pushed, "read") for _ in range(3)] == [None, None, "work"]
    time.sleep(PASS_WINDOW_S + 0.05)
    assert check.refusal(pushed, "read") is None
