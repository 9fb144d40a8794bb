"""``WS /v1/audio/speech/stream`` against the real app: text streamed in, audio streamed out."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.serving.conftest import Server, wait_ready

pytestmark = pytest.mark.slow

ROUTE = "/v1/audio/speech/stream"
RECEIVE_TIMEOUT_S = 120
# Long enough that, fed a word every 50 ms, the feeding lasts far beyond a slow first chunk.
WORDS = " ".join(f"Sentence {n} is spoken, clause by clause, while more text arrives."
                 for n in range(1, 41)).split(" ")


def open_socket(server: Server, headers: dict[str, str] | None = None) -> ClientConnection:
    url = server.base_url.replace("http://", "ws://") + ROUTE
    return connect(url, additional_headers=server.auth if headers is None else headers,
                   max_size=None, open_timeout=60)


def send(socket: ClientConnection, kind: str, **fields: Any) -> None:
    socket.send(json.dumps({"type": kind, **fields}))


def receive_event(socket: ClientConnection) -> dict[str, Any]:
    """The next JSON event (binary frames before it are skipped)."""
    while True:
        message = socket.recv(timeout=RECEIVE_TIMEOUT_S)
        if isinstance(message, str):
            return json.loads(message)


def start(socket: ClientConnection, **fields: Any) -> dict[str, Any]:
    send(socket, "session.start", response_format="pcm", sample_rate=24000, **fields)
    started = receive_event(socket)
    assert started["type"] == "session.started", started
    return started


def drain(socket: ClientConnection) -> tuple[list[dict[str, Any]], bytes]:
    """Every event and all audio until the server closes the socket."""
    events, audio = [], bytearray()
    try:
        while True:
            message = socket.recv(timeout=RECEIVE_TIMEOUT_S)
            if isinstance(message, bytes):
                audio.extend(message)
            else:
                events.append(json.loads(message))
    except ConnectionClosed:
        pass
    return events, bytes(audio)


def engine_stats(server: Server) -> dict[str, int]:
    return server.synthesizer_stats()["engine"]


def test_audio_arrives_while_text_is_still_being_fed(server: Server) -> None:
    with open_socket(server) as socket:
        start(socket)
        state = {"done_sent": False}
        audio_seen = threading.Event()

        def feed() -> None:
            for index, word in enumerate(WORDS):
                send(socket, "input_text.delta", delta=word if index == 0 else " " + word)
                if audio_seen.wait(0.05):
                    break  # the point is made: the rest may go at once
            for word in WORDS[index + 1:]:
                send(socket, "input_text.delta", delta=" " + word)
            state["done_sent"] = True
            send(socket, "input_text.done")

        feeder = threading.Thread(target=feed)
        feeder.start()
        first = socket.recv(timeout=RECEIVE_TIMEOUT_S)
        while isinstance(first, str):
            event = json.loads(first)
            assert event["type"] == "audio.chunk", event
            first = socket.recv(timeout=RECEIVE_TIMEOUT_S)
        audio_before_done = not state["done_sent"]
        audio_seen.set()
        events, audio = drain(socket)
        feeder.join()
    assert audio_before_done, "no audio before input_text.done was sent"
    chunks = [e for e in events if e["type"] == "audio.chunk"]
    assert events[-1]["type"] == "response.done", events[-1]
    usage = events[-1]["usage"]
    assert usage["input_tokens"] == len(" ".join(WORDS))  # piper counts characters
    # Every binary frame was announced by its chunk event (the first one was read above).
    assert sum(c["bytes"] for c in chunks) == len(audio)
    assert all(c["timings"]["since_first_delta_s"] >= 0 for c in chunks)
    assert len(first) + len(audio) > 24000 * 2 * 5


def test_cancel_frees_the_engine_slot(server: Server) -> None:
    before = engine_stats(server)
    with open_socket(server) as socket:
        start(socket)
        send(socket, "input_text.delta", delta=" ".join(WORDS[:60]))
        assert isinstance(socket.recv(timeout=RECEIVE_TIMEOUT_S), (str, bytes))
        send(socket, "cancel")
        events, _ = drain(socket)
    assert events[-1]["type"] == "response.cancelled", events[-1]
    deadline = time.monotonic() + 30
    stats = engine_stats(server)
    while stats["active_streams"] and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = engine_stats(server)
    assert stats["active_streams"] == 0
    assert stats["aborted"] == before["aborted"] + 1


BARGE_IN_TEXT = ("A voice agent speaks this answer, sentence by sentence. The user cuts in "
                 "before it ends, so only some of it is heard. The rest is never played.")


def test_barge_in_answers_with_the_words_heard_before_played_s(server: Server) -> None:
    from serve_app.engines.words import split_words

    with open_socket(server) as socket:
        send(socket, "session.start", response_format="pcm", sample_rate=24000,
             timestamp_granularities=["bogus"])
        assert receive_event(socket)["error"]["param"] == "timestamp_granularities"
        start(socket, timestamp_granularities=["word"])
        send(socket, "input_text.delta", delta=BARGE_IN_TEXT)
        words: list[dict[str, Any]] = []
        while len(words) < 3:
            event = receive_event(socket)
            assert event["type"] == "audio.chunk", event
            words += event["words"]
        assert [w["word"] for w in words] == split_words(BARGE_IN_TEXT)[:len(words)]
        played_s = words[1]["end"] + 0.001  # the second word just finished playing
        send(socket, "cancel", played_s=-1)
        assert receive_event(socket)["error"]["param"] == "played_s"  # the session goes on
        send(socket, "cancel", played_s=played_s)
        events, _ = drain(socket)
    cancelled = [e for e in events if e["type"] != "audio.chunk"]
    assert cancelled == [{"type": "response.cancelled", "played_s": played_s,
                          "spoken_text": " ".join(w["word"] for w in words[:2])}]


def test_without_word_times_chunks_have_no_words_and_spoken_text_is_null(
        server: Server) -> None:
    with open_socket(server) as socket:
        start(socket)
        send(socket, "input_text.delta", delta=BARGE_IN_TEXT)
        event = receive_event(socket)
        assert event["type"] == "audio.chunk" and "words" not in event
        send(socket, "cancel", played_s=0.5)
        events, _ = drain(socket)
    assert events[-1] == {"type": "response.cancelled", "played_s": 0.5, "spoken_text": None}


def test_hostile_messages_get_error_events_and_the_service_keeps_serving(
        server: Server) -> None:
    with open_socket(server) as socket:
        socket.send(b"\x00\x01binary")
        assert receive_event(socket)["error"]["code"] == "binary_message"
        send(socket, "input_text.delta", delta="too early")
        assert receive_event(socket)["error"]["code"] == "session_not_started"
        socket.send("{not json")
        assert receive_event(socket)["error"]["code"] == "invalid_json"
        send(socket, "session.start", sample_rate=12345)
        assert receive_event(socket)["error"]["param"] == "sample_rate"
        start(socket)
        send(socket, "speak.louder")
        assert receive_event(socket)["error"]["code"] == "unknown_type"
        send(socket, "input_text.delta", delta="x" * 5000)
        assert receive_event(socket)["error"]["code"] == "delta_too_long"
        send(socket, "input_text.delta", delta=42)
        assert receive_event(socket)["error"]["param"] == "delta"
        send(socket, "input_text.delta", delta="Still speaking after all that.")
        send(socket, "input_text.done")
        send(socket, "input_text.delta", delta="And this comes too late.")
        events, audio = drain(socket)
    codes = [e["error"]["code"] for e in events if e["type"] == "error"]
    assert codes == ["input_done"]
    assert events[-1]["type"] == "response.done" and len(audio) > 24000
    reply = httpx.post(f"{server.base_url}/v1/audio/speech", headers=server.auth, timeout=120,
                       json={"model": "tts-1", "voice": "alloy", "input": "Still here."})
    assert reply.status_code == 200


def test_auth_by_header_or_api_key_field(server: Server) -> None:
    with open_socket(server, headers={}) as socket:
        send(socket, "session.start", api_key="wrong")
        event = receive_event(socket)
        assert event["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=RECEIVE_TIMEOUT_S)
        assert closed.value.rcvd.code == 1008
    with open_socket(server, headers={}) as socket:
        start(socket, api_key=server.api_key)
        send(socket, "input_text.delta", delta="Keys in the message work for browsers.")
        send(socket, "input_text.done")
        events, audio = drain(socket)
    assert events[-1]["type"] == "response.done" and audio


# ---- several Synthesizer replicas: text reaches the replica that holds its stream -----------

PINNED_APP, PINNED_PREFIX = "pinned", "/pinned"


@pytest.fixture(scope="module")
def two_replicas(server: Server) -> Server:
    """The session's graph again, with two Synthesizer replicas, under /pinned."""
    from ray import serve

    from serve_app.config import ApiConfig
    from serve_app.front.ingress import Ingress
    from serve_app.gpu.synthesizer import Synthesizer

    synthesizer = Synthesizer.options(num_replicas=2, ray_actor_options={"num_cpus": 0.1}).bind(
        "piper", {"intra_op_threads": 1, "max_batch_size": 4})
    ingress = Ingress.options(ray_actor_options={"num_cpus": 0.05}).bind(
        synthesizer, ApiConfig(api_key=server.api_key).model_dump())
    serve.run(ingress, name=PINNED_APP, route_prefix=PINNED_PREFIX)
    app = Server(base_url=f"{server.base_url}{PINNED_PREFIX}", api_key=server.api_key,
                 metrics_url=server.metrics_url, voice_store=server.voice_store)
    wait_ready(app.base_url, "the two-replica app")
    yield app
    serve.delete(PINNED_APP)


def synthesizer_replica_ids() -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{PINNED_APP}#Synthesizer#"
    return [actor["name"][len(prefix):] for actor in ray.util.list_named_actors(True)
            if actor["name"].startswith(prefix)]


def open_streamed(handle, request_id: str):
    """A streamed-input request opened on some replica through the handle: its TextInputOpen
    and the rest of its stream."""
    from serve_app.engines.base import SpeechRequest
    from serve_app.messages import TextInputOpen

    stream = handle.synthesize.options(stream=True).remote(
        SpeechRequest(request_id=request_id, text="", text_input="streamed"))
    first = next(stream)
    assert isinstance(first, TextInputOpen), first
    return first, stream


def test_each_replica_takes_text_through_its_own_inbox(two_replicas: Server) -> None:
    import ray
    from ray import serve

    from serve_app.engines.base import AudioChunk
    from serve_app.engines.text_rule import MAX_TEXT_CHARS

    handle = serve.get_deployment_handle("Synthesizer", app_name=PINNED_APP)
    inboxes: dict[str, Any] = {}
    text = "Text put straight into the replica's inbox."
    for n in range(40):
        opened, stream = open_streamed(handle, f"inbox-{n}")
        assert ray.get(opened.text_inbox.put.remote(f"inbox-{n}", text), timeout=60) is None
        # The engine's refusal comes back as the answer, the stream goes on.
        refused = ray.get(opened.text_inbox.put.remote(f"inbox-{n}", "x" * MAX_TEXT_CHARS),
                          timeout=60)
        assert refused.code == "text_too_long", refused
        assert ray.get(opened.text_inbox.put.remote(f"inbox-{n}", "", True), timeout=60) is None
        chunks = [item for item in stream if isinstance(item, AudioChunk)]
        assert chunks[-1].final and chunks[-1].usage.input_tokens == len(text)
        inboxes[opened.replica_id] = opened.text_inbox
        if len(inboxes) == 2:
            break
    assert sorted(inboxes) == sorted(synthesizer_replica_ids())
    for inbox in inboxes.values():
        refused = ray.get(inbox.put.remote("no-such-stream", "text"), timeout=60)
        assert refused.code == "unknown_stream", refused


def test_sessions_spread_over_replicas_all_get_their_text(two_replicas: Server) -> None:
    texts = [f"Session {n} says its own words, {'and more ' * n}then stops." for n in range(4)]
    results: list[tuple[list[dict[str, Any]], bytes]] = [([], b"")] * len(texts)

    def session(index: int) -> None:
        with open_socket(two_replicas) as socket:
            start(socket)
            for word in texts[index].split(" "):
                send(socket, "input_text.delta", delta=word + " ")
            send(socket, "input_text.done")
            results[index] = drain(socket)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for text, (events, audio) in zip(texts, results):
        assert events[-1]["type"] == "response.done", events[-1]
        assert not [e for e in events if e["type"] == "error"]
        assert events[-1]["usage"]["input_tokens"] == len(text) + 1  # each word plus a space
        assert len(audio) > 24000


def test_the_voice_agent_example_cuts_in_and_prints_the_words_heard(
        server: Server, tmp_path) -> None:
    import subprocess
    import sys

    from tests.serving.conftest import ROOT

    (tmp_path / "speech.txt").write_text(BARGE_IN_TEXT, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "voice_agent.py"),
         "--url", server.base_url.replace("http://", "ws://") + ROUTE,
         "--api-key", server.api_key, "--text-file", "speech.txt", "--words-per-s", "50",
         "--out", "agent.pcm", "--words", "--barge-in-s", "1.5"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    captions = [line.split("] ", 1)[1] for line in lines if line.startswith("[")]
    assert captions[:3] == BARGE_IN_TEXT.split()[:3]
    [heard] = [line for line in lines if line.startswith("cut in after 1.5 s; heard: ")]
    spoken = heard.split("heard: ", 1)[1].strip("'\"")
    assert spoken and BARGE_IN_TEXT.startswith(spoken) and len(spoken) < len(BARGE_IN_TEXT)


# ---- a full or draining Synthesizer replica still takes the text of its open streams --------

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
    serve.run(ingress, name=SMALL_APP, route_prefix=SMALL_PREFIX)
    app = Server(base_url=f"{server.base_url}{SMALL_PREFIX}", api_key=server.api_key,
                 metrics_url=server.metrics_url, voice_store=server.voice_store)
    wait_ready(app.base_url, "the small app")
    yield app
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
