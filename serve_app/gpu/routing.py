"""The Synthesizer's request router: a speech stream goes to a replica with room for its work.

Serve's default router picks the shorter queue of two random replicas; a queue's length says
nothing of what a stream costs (a chat stream is about four read streams of engine time), so one
replica can refuse a stream that another could run in real time. Each Synthesizer replica
reports its engine's headroom (``Synthesizer.record_routing_stats``: how many more read and chat
streams fit its real-time budget, ``EngineStats.headroom``), and :class:`WorkRouter` ranks the
replicas by it:

1. replicas with room for one more stream of the request's kind, two of them at random (so the
   ingress replicas' routers do not all pile onto the one that reported most), the roomier first;
2. then the rest, roomiest first: every engine may have freed work since it reported, and the
   one chosen refuses at once if not (503 with ``Retry-After``, before any work is spent).

A request is refused only when the replica it reaches has no room, which the ranking makes the
case only when no replica reported room. Reports come every ``request_routing_stats_period_s``;
between two reports the router counts what it sent to each replica against its headroom.
Calls other than ``synthesize`` (info, stats, voices) go to any replica, as Serve's own router
would send them. ``build_app`` sets it as the Synthesizer's ``request_router_config``
(``serve_app/app.py:WORK_ROUTING``), for every profile.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from serve_app.engines.base import SpeechRequest

HEADROOM = "headroom_{kind}"  # record_routing_stats' keys: streams of that kind that still fit
STAMP = "reported_at"  # when the replica made the report (its clock)


def routing_stats(stats: Any, reported_at: float) -> dict[str, float]:
    """What a Synthesizer replica reports for routing, from its engine's ``EngineStats``."""
    return {HEADROOM.format(kind="read"): stats.headroom("read"),
            HEADROOM.format(kind="chat"): stats.headroom("chat"),
            STAMP: reported_at}


class WorkRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes each speech stream to a replica whose engine has room for it (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        # per replica: (the report counted against, streams of each kind sent since it)
        self._sent: dict[ReplicaID, tuple[Any, dict[str, int]]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        kind = _kind_of(pending_request)
        replicas = list(candidate_replicas)
        random.shuffle(replicas)
        if kind is None or not replicas:
            return [replicas]
        by_id = {r.replica_id: r for r in replicas}
        ranks = ranked({r.replica_id: self._headroom(r, kind) for r in replicas})
        return [[by_id[replica_id] for replica_id in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        kind = _kind_of(pending_request)
        if kind is None:
            return
        replica = self.curr_replicas.get(replica_id)
        report = replica.routing_stats.get(STAMP) if replica is not None else None
        counted, sent = self._sent.get(replica_id, (None, {}))
        if counted != report:
            sent = {}
        sent[kind] = sent.get(kind, 0) + 1
        self._sent[replica_id] = (report, sent)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._sent.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)

    def _headroom(self, replica: RunningReplica, kind: str) -> float:
        stats = replica.routing_stats or {}
        counted, sent = self._sent.get(replica.replica_id, (None, {}))
        return room_left(stats, kind, sent if counted == stats.get(STAMP) else {})


def room_left(stats: dict[str, float], kind: str, sent: dict[str, int]) -> float:
    """Streams of ``kind`` a replica has room for: its last report (``stats``) less what was
    sent it since (``sent``, by kind), each sent stream weighed by its kind's cost against
    ``kind``'s (the ratio of the two headrooms). A replica that has not reported has room."""
    headroom = stats.get(HEADROOM.format(kind=kind))
    if headroom is None:
        return float("inf")
    used = 0.0
    for other, count in sent.items():
        other_room = stats.get(HEADROOM.format(kind=other)) or 0.0
        used += count * (headroom / other_room if other_room > 0 else 1.0)
    return float(headroom) - used


def ranked(rooms: dict[Any, float]) -> list[list[Any]]:
    """Replica ids (in the order given: shuffled by the caller) in ranks: two of those with
    room for one more stream, the roomier first; then every other, roomiest first."""
    with_room = [replica for replica, room in rooms.items() if room >= 1.0]
    first = sorted(with_room[:2], key=lambda replica: -rooms[replica])
    rest = sorted((replica for replica in rooms if replica not in first),
                  key=lambda replica: -rooms[replica])
    return [first, rest] if first else [rest]


def _kind_of(pending_request: PendingRequest | None) -> str | None:
    """A speech stream's kind ("read" or "chat"), None for other calls."""
    if pending_request is None:
        return None
    request = next((a for a in pending_request.args if isinstance(a, SpeechRequest)), None)
    return None if request is None else request.mode
