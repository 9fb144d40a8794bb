"""The MiniCPM-o scheduler's gate admitting by work: a stream for which no slot is free is
refused at once (it would wait for another to end), a streamed-text session's queued stream
keeps its place however long it waits, and admitting by slots queues as before."""

from __future__ import annotations

import pytest

from serve_app.engines.base import EngineOverloadedError, SpeechRequest
from serve_app.engines.minicpmo.scheduler import Scheduler, Stream, StreamPlan
from serve_app.engines.streamed_text import StreamedText
from serve_app.engines.work_admission import StreamWork, WorkAdmission

TEXT = "A slot for every stream it takes."


def stream(name: str, chat: bool = False, session: bool = False) -> Stream:
    plan = StreamPlan(SpeechRequest(name, TEXT, mode="chat" if chat else "read"), prompt="",
                      pieces=None if chat else [TEXT])
    return Stream(plan, sink=lambda items: None, submitted_at=0.0,
                  fed_text=StreamedText(max_chars=1000) if session else None)


def scheduler(mode: str, slots: int = 2, chat_slots: int = 1) -> Scheduler:
    work = WorkAdmission(mode, 0.0, 0.5, max_slots=64, max_chat_slots=16)
    return Scheduler(slots, chat_slots, max_queued=64, admission_interval_steps=1, work=work,
                     admissions_per_step=16)


def test_admitting_by_work_a_stream_without_a_free_slot_is_refused_at_once():
    gate = scheduler("work")
    gate.enqueue([stream("a")])
    gate.enqueue([stream("b")])
    with pytest.raises(EngineOverloadedError) as refused:
        gate.enqueue([stream("c")])  # two slots, two queued ahead of it
    assert refused.value.reason == "slots"
    assert gate.stats().refused_slots == 1
    assert [s.request_id for s in gate.admit(0)] == ["a", "b"]
    with pytest.raises(EngineOverloadedError):
        gate.enqueue([stream("d")])  # both slots run


def test_a_chat_stream_needs_a_free_llm_slot_too():
    gate = scheduler("work", slots=4, chat_slots=1)
    gate.enqueue([stream("chat-1", chat=True)])
    with pytest.raises(EngineOverloadedError) as refused:
        gate.enqueue([stream("chat-2", chat=True)])
    assert refused.value.reason == "slots"
    gate.enqueue([stream("read-1")])  # a read stream still has a slot


def test_admitting_by_slots_the_queue_waits_as_before():
    gate = scheduler("slots")
    for name in "abcde":
        gate.enqueue([stream(name)])
    assert len(gate.admit(0)) == 2 and gate.stats().queued_streams == 3


def test_a_sessions_queued_stream_keeps_its_place_however_long_it_waits():
    gate = scheduler("work")
    gate.enqueue([stream("session", session=True)])
    gate.enqueue([stream("plain")])
    expired = gate.expire_waiting(now=60.0)  # both waited a minute
    assert [s.request_id for s in expired] == ["plain"]
    assert [s.request_id for s in gate.admit(0)] == ["session"]


def test_its_stats_say_how_many_slots_are_free_and_the_headroom_counts_them():
    gate = scheduler("work", slots=3)
    gate.enqueue([stream("a")])
    stats = gate.stats()
    assert stats.free_slots == 2
    assert stats.headroom("read") == 2.0  # the budget would take far more: the slots bound it
    gate.enqueue([stream("b")])
    gate.enqueue([stream("c")])
    full = gate.stats()
    assert not full.has_room("read") and full.refusal_reason("read") == "slots"
    assert scheduler("slots").stats().free_slots == -1  # admitting by slots it queues


def test_the_look_before_planning_refuses_as_the_queue_would_and_takes_nothing():
    gate = scheduler("work")
    gate.check_room(StreamWork())  # room: nothing is taken by looking
    assert gate.stats().queued_streams == 0 and gate.stats().admitted_streams == 0
    gate.enqueue([stream("a")])
    gate.enqueue([stream("b")])
    with pytest.raises(EngineOverloadedError) as refused:
        gate.check_room(StreamWork())  # both slots taken by the queue
    assert refused.value.reason == "slots"
    assert gate.stats().refused_slots == 1
    assert gate.stats().queued_streams == 2
