"""``WS /v1/audio/speech/stream`` against the real app: text streamed in, audio streamed out."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from tests.serving.conftest import Server
from tests.serving.socket_session import (RECEIVE_TIMEOUT_S, ROUTE, drain, open_socket,
                                          open_streamed, receive_event, send, serve_beside, start)

pytestmark = pytest.mark.slow

# Long enough that, fed a word every 50 ms, the feeding lasts far beyond a slow first chunk.
WORDS = " ".join(f"Sentence {n} is spoken, clause by clause, while more text arrives."
                 for n in range(1, 41)).split(" ")


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
    yield serve_beside(server, ingress, PINNED_APP, PINNED_PREFIX, "the two-replica app")
    serve.delete(PINNED_APP)


def synthesizer_replica_ids() -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{PINNED_APP}#Synthesizer#"
    return [actor["name"][len(prefix):] for actor in ray.util.list_named_actors(True)
            if actor["name"].startswith(prefix)]


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
