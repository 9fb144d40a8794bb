"""``WS /v1/audio/speech/stream`` against the real app: a full or draining Synthesizer replica
still takes the text of its open streams (through its text inbox), and a gone replica takes its
inbox along."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection

from tests.serving.conftest import Server
from tests.serving.socket_session import (drain, open_socket, open_streamed, receive_event, send,
                                          serve_beside, start)

pytestmark = pytest.mark.slow

SMALL_APP, SMALL_PREFIX, SMALL_SYNTH_APP = "small", "/small", "small-synth"
SMALL_MAX_ONGOING = 2
# Waits long enough that a stream waiting for text is never cut by a timeout in these tests.
PATIENT_S = 600
FULL_TEXT = "The replica is full, yet this session's words still reach its engine and are spoken."


def deploy_small_synthesizer() -> None:
    """One Synthesizer replica that takes SMALL_MAX_ONGOING requests at once, as an app of its
    own: deploying it again replaces the replica (Serve gives every ``serve.run`` a new
    version), and the old one drains, while the Ingress (another app) stays."""
    from ray import serve

    from serve_app.gpu.synthesizer import Synthesizer

    synthesizer = Synthesizer.options(
        num_replicas=1, max_ongoing_requests=SMALL_MAX_ONGOING, graceful_shutdown_timeout_s=300,
        ray_actor_options={"num_cpus": 0.1},
    ).bind("piper", {"intra_op_threads": 1, "max_batch_size": 4},
           first_chunk_timeout_s=PATIENT_S, chunk_timeout_s=PATIENT_S)
    serve.run(synthesizer, name=SMALL_SYNTH_APP, route_prefix=None)


@pytest.fixture(scope="module")
def small_app(server: Server) -> Server:
    """An Ingress that waits PATIENT_S for text and audio, in front of the small Synthesizer."""
    from ray import serve

    from serve_app.config import ApiConfig
    from serve_app.front.ingress import Ingress

    deploy_small_synthesizer()
    api = ApiConfig(api_key=server.api_key, ws_idle_timeout_s=PATIENT_S, handle_timeout_s=10,
                    first_chunk_timeout_s=PATIENT_S, chunk_timeout_s=PATIENT_S)
    synthesizer = serve.get_deployment_handle("Synthesizer", app_name=SMALL_SYNTH_APP)
    ingress = Ingress.options(ray_actor_options={"num_cpus": 0.05}).bind(synthesizer,
                                                                         api.model_dump())
    yield serve_beside(server, ingress, SMALL_APP, SMALL_PREFIX, "the small app")
    serve.delete(SMALL_APP)
    serve.delete(SMALL_SYNTH_APP)


def feed_all(socket: ClientConnection, text: str) -> None:
    for word in text.split(" "):
        send(socket, "input_text.delta", delta=word + " ")
    send(socket, "input_text.done")


def assert_spoken_whole(events: list[dict[str, Any]], audio: bytes, chars: int) -> None:
    assert not [e for e in events if e["type"] == "error"], events
    assert events[-1]["type"] == "response.done", events[-1]
    assert events[-1]["usage"]["input_tokens"] == chars  # every delta reached the engine
    assert len(audio) > 24000


def test_text_reaches_a_replica_at_max_ongoing_requests(small_app: Server) -> None:
    """Every stream takes one of the replica's max_ongoing_requests: with two sessions open the
    replica is full, and the text of both still gets in."""
    texts = [FULL_TEXT, "A second session holds the other slot and speaks after the first."]
    with open_socket(small_app) as first, open_socket(small_app) as second:
        start(first)
        start(second)  # both streams are in the engine: the replica is at capacity
        feed_all(first, texts[0])
        events, audio = drain(first)
        assert_spoken_whole(events, audio, len(texts[0]) + 1)  # each word plus a space
        feed_all(second, texts[1])
        events, audio = drain(second)
        assert_spoken_whole(events, audio, len(texts[1]) + 1)


def synthesizer_replica_states(app_name: str) -> dict[str, int]:
    from ray import serve

    deployment = serve.status().applications[app_name].deployments["Synthesizer"]
    return {getattr(state, "value", state): count
            for state, count in deployment.replica_states.items()}


def test_a_draining_replica_still_takes_the_text_of_its_sessions(small_app: Server) -> None:
    """A new deployment replaces the replica while a session still sends text: the old replica
    drains, finishing its open streams, and their text keeps reaching it."""
    words = FULL_TEXT.split(" ")
    half = len(words) // 2
    with open_socket(small_app) as socket:
        start(socket)
        for word in words[:half]:
            send(socket, "input_text.delta", delta=word + " ")
        assert receive_event(socket)["type"] == "audio.chunk"  # the stream runs
        redeploy = threading.Thread(target=deploy_small_synthesizer)
        redeploy.start()
        deadline = time.monotonic() + 300
        while not synthesizer_replica_states(SMALL_SYNTH_APP).get("STOPPING"):
            assert time.monotonic() < deadline, "the old replica never started to drain"
            time.sleep(0.2)
        # The old replica drains (it finishes its streams; Serve routes nothing new to it).
        # Give every router a moment to take it off its list, as a later text would meet.
        time.sleep(2)
        feed_all(socket, " ".join(words[half:]))
        events, audio = drain(socket)
        redeploy.join(timeout=300)
    assert not redeploy.is_alive()
    assert_spoken_whole(events, audio, len(FULL_TEXT) + 1)


def test_a_gone_replica_ends_its_sessions_with_an_error_and_its_inbox_dies_with_it(
        small_app: Server) -> None:
    """Killed, the replica takes its inbox along: text put there raises at once, and an open
    session ends with an error event (whichever of its text or its audio notices first)."""
    import ray
    from ray import serve
    from ray.exceptions import RayActorError

    handle = serve.get_deployment_handle("Synthesizer", app_name=SMALL_SYNTH_APP)
    opened, stream = open_streamed(handle, "doomed")
    prefix = f"SERVE_REPLICA::{SMALL_SYNTH_APP}#Synthesizer#"
    [name] = [actor["name"] for actor in ray.util.list_named_actors(True)
              if actor["name"] == prefix + opened.replica_id]
    with open_socket(small_app) as socket:
        start(socket)  # its stream is on the same, only replica
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        with pytest.raises(RayActorError):
            ray.get(opened.text_inbox.put.remote("doomed", "Nobody hears this."), timeout=120)
        try:
            feed_all(socket, FULL_TEXT)
        except ConnectionClosed:
            pass  # the session already ended
        events, _ = drain(socket)
    assert events[-1]["type"] == "error", events[-1]
    assert events[-1]["error"]["code"] in ("stream_lost", "synthesis_unavailable",
                                           "stream_cut"), events[-1]
    del stream
