"""The Synthesizer's request router's choice (serve_app/gpu/routing.py): what room a replica
has for a stream of a kind, counting what was sent to it since its report, and how replicas
are ranked by it. (The router itself runs in every served test, on Serve's own machinery.)"""

from __future__ import annotations

import pytest

from serve_app.engines.base import EngineStats
from serve_app.gpu.routing import ranked, room_left, routing_stats


def test_a_replica_reports_the_read_and_chat_streams_that_still_fit():
    stats = EngineStats(max_slots=1024, work_load=0.3, work_limit=0.5,
                        read_stream_load=0.0005, chat_stream_load=0.002)
    report = routing_stats(stats, reported_at=12.0)
    assert report["headroom_read"] == pytest.approx(400)
    assert report["headroom_chat"] == pytest.approx(100)
    assert report["reported_at"] == 12.0


def test_streams_sent_since_the_report_use_its_room_by_their_cost():
    report = {"headroom_read": 400.0, "headroom_chat": 100.0}
    assert room_left(report, "read", {}) == 400.0
    # a chat stream takes four read streams' room here, a read stream a quarter of a chat's
    assert room_left(report, "read", {"read": 10, "chat": 5}) == pytest.approx(400 - 10 - 20)
    assert room_left(report, "chat", {"read": 40}) == pytest.approx(100 - 10)
    assert room_left({}, "read", {"read": 3}) == float("inf")  # not reported yet: room


def test_replicas_with_room_come_first_and_a_full_one_last():
    rooms = {"a": 0.2, "b": 30.0, "c": 5.0, "d": 80.0}
    assert ranked(rooms) == [["b", "c"], ["d", "a"]]  # two with room (as given), roomier first
    assert ranked({"a": 0.0, "b": 0.5}) == [["b", "a"]]  # none has room: the roomiest first
