"""Routing of calls to the Synthesizer: text for a streamed-input request goes to its replica.

A WebSocket session's audio stream runs ``Ingress -> Synthesizer``; the text it
is fed later must reach the *same* Synthesizer replica, the one whose engine holds the stream.
Serve routes every handle call on its own, so the stream announces its replica id
(:class:`~serve_app.messages.TextInputOpen`) and each ``feed_text`` call names it in the
``pinned_replica`` keyword; this router sends such a call to that replica only. Every other call
goes to the less busy of two random replicas, as Serve's default router does.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

PIN_KEYWORD = "pinned_replica"
ROUTER_PATH = "serve_app.gpu.routing.PinnedReplicaRouter"


def pinned_replica(request: PendingRequest | None) -> Any:
    """The replica id a call is pinned to, or None."""
    return None if request is None else request.kwargs.get(PIN_KEYWORD)


class PinnedReplicaRouter(RequestRouter):
    """Pinned calls to their replica; others by the power of two choices.

    Without Serve's FIFO mixin a replica found for one pending call is never handed to another
    (which could be pinned elsewhere). A pinned replica that is gone yields no candidate: the
    call waits (with Serve's backoff) until its caller's timeout ends it.
    """

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        target = pinned_replica(pending_request)
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]
