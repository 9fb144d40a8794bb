"""Reliability rules on a real app over HTTP: auth, limits, overload, disconnects, faults, drain.

A second application ("hardened", under /hardened) runs beside the session's app, with small
limits, several keys (a file and an environment variable) and the engine's fault injection on,
so crashing its synthesizer never disturbs the other tests (tests/serving/hardened_app.py).
Its last test deletes it.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.served.served_logs import INGRESS_LINE
from tests.audio.decoding import decode_audio
from tests.serving.conftest import Server, wait_ready
from tests.serving.hardened_app import (
    APP,
    BODY_TIMEOUT_S,
    CRASH,
    ENV_KEY,
    FAIL,
    FILE_KEYS,
    FIRST_CHUNK_TIMEOUT_S,
    LONG_TEXT,
    MAX_AUDIO_S,
    MAX_STREAM_S,
    MAX_STREAMS,
    PREFIX,
    SLOW,
    STALL,
    TEXT,
    Hardened,
    StreamResult,
    assert_json_error,
    assert_same_audio,
    deploy,
    hardened_args,
    reference,
    speak,
    stream_all,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hardened(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Hardened:
    from ray import serve

    keys_file = tmp_path_factory.mktemp("keys") / "api_keys.txt"
    keys_file.write_text("# one key per line, or comma-separated\n"
                         f"{FILE_KEYS[0]}\n{FILE_KEYS[1]}, {FILE_KEYS[2]}\n{FILE_KEYS[3]}\n")
    args = hardened_args(keys_file)
    deploy(args)
    app = Hardened(base_url=f"{server.base_url}{PREFIX}", args=args)
    # serve.run returns before every proxy routes the new prefix: wait until it answers.
    wait_ready(app.base_url, "the hardened app", timeout_s=120)
    yield app
    if APP in serve.status().applications:
        serve.delete(APP)


# ---- auth --------------------------------------------------------------------------------

def test_keys_from_file_and_env_are_accepted_in_constant_time_and_others_get_401(
        hardened: Hardened) -> None:
    for key in (*FILE_KEYS, ENV_KEY):
        with hardened.client(key) as client:
            assert speak(client, "Hi.").status_code == 200, key
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": f"Basic {ENV_KEY}"},
                    {"authorization": f"Bearer {FILE_KEYS[0]}x"}):
        response = httpx.post(f"{hardened.base_url}/v1/speech/stream", json={"text": "Hi."},
                              headers=headers, timeout=30)
        assert_json_error(response, 401, "invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"


def test_per_key_stream_limit_answers_429_and_frees_on_close(hardened: Hardened) -> None:
    key = FILE_KEYS[1]
    with hardened.client(key) as one, hardened.client(key) as two, \
            hardened.client(key) as three:
        with one.stream("POST", "/v1/speech/stream", json={"text": f"{SLOW} {LONG_TEXT}"}) as a, \
                two.stream("POST", "/v1/speech/stream",
                           json={"text": f"{SLOW} {LONG_TEXT}"}) as b:
            assert a.status_code == b.status_code == 200
            assert_json_error(speak(three, "Hi."), 429, "too_many_streams")
            with hardened.client(FILE_KEYS[2]) as other:
                assert speak(other, "Hi.").status_code == 200  # other keys are unaffected
        # Both streams closed: the key's permits come back.
        deadline = time.monotonic() + 10
        while (status := speak(three, "Hi.").status_code) == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 200


# ---- limits and timeouts -----------------------------------------------------------------

def test_audio_per_request_is_capped_at_max_audio_s_and_ends_cleanly(hardened: Hardened) -> None:
    with hardened.client() as client:
        response = speak(client, LONG_TEXT * 3, sample_rate=16000)
    assert response.status_code == 200
    samples, _ = decode_audio(response.content, "pcm", 16000)
    assert abs(len(samples) - MAX_AUDIO_S * 16000) <= 2


def test_a_body_that_never_arrives_gets_408_json(hardened: Hardened) -> None:
    host, port = hardened.base_url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall((f"POST {PREFIX}/v1/speech/stream HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: Bearer {FILE_KEYS[0]}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode())
        started = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            piece = raw.recv(65536)
            if not piece:
                break
            reply += piece
    assert time.monotonic() - started >= BODY_TIMEOUT_S - 0.5
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert b'"code":"request_timeout"' in body


def test_a_stalled_engine_stream_times_out_with_504_json_and_frees_its_slot(
        hardened: Hardened) -> None:
    aborted = hardened.settled_engine()["aborted"]
    started = time.monotonic()
    with hardened.client() as client:
        response = speak(client, f"{STALL} {LONG_TEXT}")
    assert_json_error(response, 504, "timeout")
    waited_s = time.monotonic() - started
    assert FIRST_CHUNK_TIMEOUT_S - 0.5 <= waited_s <= FIRST_CHUNK_TIMEOUT_S + 5
    stats = hardened.wait_engine(lambda s: s["aborted"] > aborted)
    assert stats["aborted"] == aborted + 1 and stats["active_streams"] == 0


def test_a_slow_stream_is_cut_at_the_wall_clock_limit(hardened: Hardened) -> None:
    with hardened.client() as client:
        # Each chunk in time, but over ten of them 2 s apart: the wall-clock limit ends it.
        result = stream_all(client, f"{SLOW} {LONG_TEXT * 4}")
    assert result.status == 200 and result.error is not None
    assert MAX_STREAM_S - 0.5 <= result.elapsed_s <= MAX_STREAM_S + 5
    assert hardened.wait_engine(lambda s: s["active_streams"] == 0)["active_streams"] == 0


# ---- overload ----------------------------------------------------------------------------

def test_overload_beyond_the_bounded_queues_is_503_json_with_retry_after(
        hardened: Hardened) -> None:
    keys = [*FILE_KEYS, ENV_KEY]
    # All requests leave together, however slowly a busy machine starts the threads; each
    # admitted stream then holds its place for SLOW_DELAY_S, far longer than the burst takes.
    together = threading.Barrier(MAX_STREAMS + 2)

    def one(index: int) -> StreamResult:
        with hardened.client(keys[index % len(keys)]) as client:
            together.wait(60)
            # One chunk, SLOW_DELAY_S late: the queued ones still get their turn in time.
            return stream_all(client, f"{SLOW} Hi.")

    # More streams than the synthesizer runs and queues (4 + 2) and than the ingress admits (8).
    with ThreadPoolExecutor(MAX_STREAMS + 2) as pool:
        results = list(pool.map(one, range(MAX_STREAMS + 2)))
    seen = [(r.status, r.error, r.text) for r in results]
    # Refused streams answer 503 (queues full) or 429 (a key's concurrent-stream limit, which
    # a burst spread over few keys can hit first); both are JSON errors, nothing else appears.
    assert {r.status for r in results} <= {200, 429, 503}, seen
    refused = sum(r.status in (429, 503) for r in results)
    # The ingress's own bound refuses at least the two beyond MAX_STREAMS (the burst is all in
    # flight at once). How many more Serve's queue bounds refuse depends on when its router
    # sees the replicas' queues, so it is not asserted.
    assert refused >= 2, seen
    for result in results:
        # Nothing hangs: the client's 60 s read timeout would show as an error.
        assert result.elapsed_s < 60, seen
        if result.status == 200:
            # An admitted stream plays to its end (a cut body sets `error`).
            assert result.error is None and len(result.body) > 0, seen
        else:
            assert_json_error(result, result.status)
    # Afterwards everything is released and the service serves normally.
    assert hardened.wait_engine(lambda s: s["active_streams"] == 0)["active_streams"] == 0
    with hardened.client() as client:
        assert speak(client, "Hi.").status_code == 200


# ---- disconnects and fault isolation -----------------------------------------------------

def test_disconnect_frees_the_slot_at_once_and_leaves_other_streams_untouched(
        hardened: Hardened) -> None:
    expected = reference(hardened, TEXT)
    before = hardened.engine()
    other_started = threading.Event()
    with ThreadPoolExecutor(1) as pool, hardened.client(FILE_KEYS[3]) as client:
        other = pool.submit(stream_all, hardened.client(FILE_KEYS[2]), TEXT,
                            other_started, seed=3)
        other_started.wait(30)
        with client.stream("POST", "/v1/speech/stream",
                           json={"text": LONG_TEXT * 3, "format": "pcm"}) as response:
            next(response.iter_raw())
        # Closed: the abort reaches the engine and frees the slot in the same call.
        stats = hardened.wait_engine(lambda s: s["aborted"] > before["aborted"])
        assert stats["aborted"] == before["aborted"] + 1
        assert stats["active_streams"] <= 1  # at most the other stream is left
        result = other.result(60)
    assert result.status == 200 and result.error is None
    assert_same_audio(result.body, expected)
    assert hardened.engine()["completed"] >= before["completed"] + 1


def test_a_failing_request_ends_its_stream_with_an_error_and_the_others_continue(
        hardened: Hardened) -> None:
    expected = reference(hardened, TEXT)
    failed = hardened.engine()["failed"]
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(stream_all, hardened.client(FILE_KEYS[2]), TEXT, seed=3)
        bad = pool.submit(stream_all, hardened.client(FILE_KEYS[3]), f"{FAIL} {TEXT}")
        good_result, bad_result = good.result(60), bad.result(60)
    # Headers had gone out: the chunked body is cut without its final chunk.
    assert bad_result.status == 200 and bad_result.error == "RemoteProtocolError"
    assert good_result.status == 200 and good_result.error is None
    assert_same_audio(good_result.body, expected)
    assert hardened.engine()["failed"] == failed + 1


def test_a_failing_sse_stream_ends_with_an_error_event_after_its_audio(
        hardened: Hardened) -> None:
    body = {"model": "tts-1", "voice": "alloy", "input": f"{FAIL} {TEXT}",
            "response_format": "pcm", "stream_format": "sse"}
    with hardened.client().stream("POST", "/v1/audio/speech", json=body) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[5:]) for line in reply.iter_lines()
                  if line.startswith("data:")]
    *deltas, last = events
    assert deltas and all(event["type"] == "speech.audio.delta" for event in deltas)
    assert last["type"] == "error"
    assert set(last["error"]) == {"message", "type", "param", "code"}
    assert last["error"]["code"] == "synthesis_failed"
    with hardened.client() as client:
        assert speak(client, TEXT).status_code == 200


def serve_logs() -> dict[str, str]:
    import ray

    logs_dir = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    # Serve's replica logs are also echoed to the workers' stderr files: count lines in one.
    return {path: Path(path).read_text(errors="replace")
            for path in glob.glob(str(logs_dir / "**" / "*"), recursive=True)
            if os.path.isfile(path) and not path.endswith((".pb", ".gz"))}


def test_one_log_line_per_request_with_id_mode_sizes_ttfb_outcome_and_no_secrets(
        hardened: Hardened) -> None:
    secret_text = "Purple elephants whisper quietly at midnight."
    with hardened.client(FILE_KEYS[0]) as client:
        ok = speak(client, secret_text)
    request_id = ok.headers["x-request-id"]
    time.sleep(1.0)
    logs = serve_logs()
    lines = [line for path, text in logs.items() if "/serve/replica_" in path
             for line in text.splitlines() if f"id={request_id}" in line]
    assert len(lines) == 1, lines
    for part in ("mode=read", "format=pcm", "status=200", "outcome=ok", "ttfb_ms=",
                 f"text_chars={len(secret_text)}", "body_bytes=", "bytes_out=", "key=key#"):
        assert part in lines[0], (part, lines[0])
    # the readings bench_serve splits the front's leg by: the call to the synthesizer, its first
    # item back, the first body byte, in that order
    match = INGRESS_LINE.search(lines[0])
    assert match is not None and match[1] == request_id, lines[0]
    ttfb_ms, dispatched_ms, first_item_ms = float(match[2]), float(match[3]), float(match[4])
    assert 0 <= dispatched_ms <= first_item_ms <= ttfb_ms, lines[0]
    for path, text in logs.items():
        if not ("/serve/" in path or "/worker-" in path):
            continue  # Ray's own records of the test's runtime_env hold the env key
        for secret in (*FILE_KEYS, ENV_KEY, secret_text):
            assert secret not in text, (secret, path)


def test_a_crashed_synthesizer_is_restarted_and_its_streams_end_with_an_error(
        hardened: Hardened) -> None:
    old_pid = hardened.handle().process_info.remote().result()["pid"]
    started = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        innocent = [pool.submit(stream_all, hardened.client(key), LONG_TEXT * 2, started)
                    for key in FILE_KEYS[:2]]
        started.wait(30)
        crasher = pool.submit(stream_all, hardened.client(FILE_KEYS[2]), f"{CRASH} {TEXT}")
        results = [future.result(90) for future in (*innocent, crasher)]
    # Nothing hangs; the crasher and every stream on the dead replica end with an error.
    for result in results:
        assert result.elapsed_s < 60
        cut = result.status == 200 and result.error is not None
        refused = (result.status or 0) >= 500 and result.json is not None
        assert cut or refused, result
    # Serve restarts the replica; new requests succeed on the new process.
    deadline = time.monotonic() + 120
    with hardened.client() as client:
        while True:
            response = speak(client, "Back again.")
            if response.status_code == 200:
                break
            assert response.status_code in (503, 504), response.text
            assert time.monotonic() < deadline, "the synthesizer never came back"
            time.sleep(0.5)
    assert hardened.handle().process_info.remote().result()["pid"] != old_pid


def test_scaling_down_while_streaming_finishes_every_started_stream(hardened: Hardened) -> None:
    """Serve replaces or removes replicas gracefully: a stream that got its 200 plays to the end.

    (Serve redeploys every replica on a new serve.run, so the old ones drain here too; a request
    that lands in the switch may get a 503 with Retry-After, never a cut stream.)
    """
    expected = reference(hardened, TEXT)
    deploy(hardened.args, synth_replicas=2)
    started = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream_all, hardened.client(key), TEXT, event, seed=3)
                   for key, event in zip((*FILE_KEYS[:2], *FILE_KEYS[:2]), started)]
        for event in started:
            event.wait(30)
        deploy(hardened.args, synth_replicas=1)
        results = [future.result(120) for future in futures]
    assert sum(result.status == 200 for result in results) >= 2, results
    for result in results:
        if result.status == 503:
            assert_json_error(result, 503)
            continue
        assert result.status == 200 and result.error is None, result
        assert_same_audio(result.body, expected)


def test_shutdown_drains_streams_in_flight(hardened: Hardened) -> None:
    from ray import serve

    expected = reference(hardened, TEXT)
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream_all, hardened.client(), TEXT, started, seed=3)
        started.wait(30)
        serve.delete(APP, _blocking=False)
        result = future.result(120)
    assert result.status == 200 and result.error is None, result
    assert_same_audio(result.body, expected)
