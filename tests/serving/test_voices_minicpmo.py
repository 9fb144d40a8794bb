"""Cloned voices end to end on the tiny MiniCPM-o voice checkpoint (with its audio encoder), over
real HTTP, WebSocket, the CLI and the web page.

Two apps run side by side on the session's Ray Serve instance, each its own Ingress and
Synthesizer, with the same API keys and the same voice store folder: "a" and "b". A voice
created through one is spoken through the other, whose Ingress and Synthesizer never saw it
created: what every replica of one app sees too, since a replica knows voices only through the
store. App b's engine keeps one voice loaded, so speaking two voices there evicts and reloads.

The reference clip is real speech: the session's Piper app reads a sentence. Decoding is greedy,
so a voice's audio is the same wherever and whenever it is spoken, and equal to what the engine
itself makes in this process from the same clip. The apps and the helpers: voices_apps.py.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from serve_app.voices.clip import owner_of_key
from tests.serving.conftest import Server, speak_word_by_word, wait_ready
from tests.serving.test_web_page import CHROMIUM_ARGS, chromium_path
from tests.serving.voices_apps import (
    ALICE,
    APPS,
    BOB,
    CLIP_TEXT,
    MAX_VOICES_PER_KEY,
    TEXT,
    UPLOAD_LIMIT_BYTES,
    Voice,
    VoicesApps,
    assert_error,
    assert_same_pcm,
    create,
    engine_reference,
    pcm16,
    speak,
    voices_app,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def apps(server: Server, voice_checkpoint: Path, tmp_path_factory) -> VoicesApps:
    from ray import serve

    store = tmp_path_factory.mktemp("shared-voices")
    # Both at once: their replicas load the checkpoint side by side, not one app after the other.
    serve.run_many([
        voices_app("voices-a", APPS["a"], store, voice_checkpoint, max_engine_voices=8),
        voices_app("voices-b", APPS["b"], store, voice_checkpoint, max_engine_voices=1)])
    base = {app: f"{server.base_url}{prefix}" for app, prefix in APPS.items()}
    for app, url in base.items():
        wait_ready(url, f"voices app {app}")
    with httpx.Client(base_url=server.base_url, headers=server.auth, timeout=120) as piper:
        reply = piper.post("/v1/speech/stream", json={"text": CLIP_TEXT, "format": "wav",
                                                      "sample_rate": 16000, "seed": 1})
    assert reply.status_code == 200, reply.text
    clip_path = tmp_path_factory.mktemp("clip") / "speaker.wav"
    # A file with its real length in the header (the stream's says "unknown").
    samples, rate = sf.read(io.BytesIO(reply.content), dtype="int16")
    sf.write(clip_path, samples, rate, subtype="PCM_16")
    yield VoicesApps(base=base, store=store, clip=clip_path.read_bytes(), clip_path=clip_path,
                     checkpoint=voice_checkpoint)
    # Both deleted at once (their replicas drain side by side), then until both are gone.
    for app in APPS:
        serve.delete(f"voices-{app}", _blocking=False)
    deadline = time.monotonic() + 180
    while any(f"voices-{app}" in serve.status().applications for app in APPS):
        assert time.monotonic() < deadline, "the voices apps were never deleted"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def voice(apps: VoicesApps) -> Voice:
    """Alice's voice, created through app a, and TEXT spoken in it there."""
    with apps.client("a") as client:
        created = create(client, apps.clip)
        assert created.status_code == 200, created.text
        spoken = speak(client, created.json()["id"])
    assert spoken.status_code == 200, spoken.text
    return Voice(created.json()["id"], spoken.content)


# ---- creating and speaking ---------------------------------------------------------------------

def test_a_voice_is_created_once_stored_whole_and_spoken_as_the_engine_speaks_it(
        apps: VoicesApps, voice: Voice) -> None:
    with apps.client("a") as client:
        listed = client.get("/v1/audio/voices").json()
        one = client.get(f"/v1/audio/voices/{voice.id}").json()
    assert listed["object"] == "list" and [v["id"] for v in listed["data"]] == [voice.id]
    assert one == listed["data"][0]
    assert one["object"] == "audio.voice" and one["name"] == "Alice"
    assert abs(one["created_at"] - time.time()) < 3600
    # Stored under a hash of Alice's key: metadata, embeddings and the clip; the key nowhere.
    folder = apps.store / owner_of_key(ALICE) / voice.id
    meta = json.loads((folder / "voice.json").read_text())
    assert meta["owner"] == owner_of_key(ALICE) and meta["consent"]["attested"] is True
    assert meta["clip_seconds"] == pytest.approx(sf.info(apps.clip_path).duration, abs=0.01)
    for path in apps.store.rglob("*"):
        assert not path.is_file() or ALICE.encode() not in path.read_bytes()
    stored = np.load(folder / "embeddings.npy")
    clip, rate = sf.read(folder / "clip.flac")
    assert rate == 16000 and len(clip) == sf.info(apps.clip_path).frames
    # Computed once, at creation, by app a's Synthesizer.
    assert apps.voice_stats("a")["embeds"] == 1
    embeddings, in_voice, in_default = engine_reference(apps, voice.id)
    assert stored.shape == embeddings.shape and stored.dtype == np.float32
    np.testing.assert_allclose(stored, embeddings, rtol=1e-5, atol=1e-6)
    assert_same_pcm(voice.pcm, pcm16(in_voice))
    assert not np.array_equal(pcm16(in_voice), pcm16(in_default))  # the voice changes the audio


def test_the_voice_speaks_through_another_ingress_and_synthesizer_from_the_store(
        apps: VoicesApps, voice: Voice) -> None:
    before = apps.voice_stats("b")
    with apps.client("b") as client:
        openai = client.post("/v1/audio/speech", json={
            "model": "tts-1", "voice": voice.id, "input": TEXT, "response_format": "pcm"})
        native = speak(client, voice.id)
    assert openai.status_code == 200 and native.status_code == 200, (openai.text, native.text)
    assert_same_pcm(openai.content, voice.pcm)
    assert_same_pcm(native.content, voice.pcm)
    after = apps.voice_stats("b")
    assert after["loads"] == before["loads"] + 1  # read from the store once...
    assert after["embeds"] == before["embeds"] == 0  # ...never embedded again


def test_the_voice_survives_a_synthesizer_restart(apps: VoicesApps, voice: Voice) -> None:
    handle = apps.synthesizer("a")
    old_pid = handle.process_info.remote().result()["pid"]
    embeddings = apps.store / owner_of_key(ALICE) / voice.id / "embeddings.npy"
    stored = embeddings.read_bytes()
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 240
    with apps.client("a") as client:
        while True:
            response = speak(client, voice.id)
            if response.status_code == 200:
                break
            assert response.status_code in (503, 504), response.text
            assert time.monotonic() < deadline, "the synthesizer never came back"
            time.sleep(0.5)
    assert handle.process_info.remote().result()["pid"] != old_pid
    assert_same_pcm(response.content, voice.pcm)
    assert apps.voice_stats("a") == {"loaded": 1, "loads": 1, "embeds": 0}
    assert embeddings.read_bytes() == stored


def test_an_evicted_voice_is_loaded_again(apps: VoicesApps, voice: Voice) -> None:
    """App b's engine holds one voice: speaking another evicts the first, which the Synthesizer
    adds again when the engine says it is not loaded."""
    with apps.client("a") as client:
        second = create(client, apps.clip, name="Alice again")
    assert second.status_code == 200, second.text
    loads = apps.voice_stats("b")["loads"]
    with apps.client("b") as client:
        for voice_id in (voice.id, second.json()["id"], voice.id):
            response = speak(client, voice_id)
            assert response.status_code == 200, response.text
    assert_same_pcm(response.content, voice.pcm)
    assert apps.voice_stats("b")["loads"] >= loads + 2
    with apps.client("a") as client:
        assert client.delete(f"/v1/audio/voices/{second.json()['id']}").status_code == 200


def test_a_websocket_session_speaks_in_the_voice(apps: VoicesApps, voice: Voice) -> None:
    events, audio = speak_word_by_word(apps.base["b"], {"voice": voice.id,
                                                        "response_format": "pcm"}, TEXT,
                                       headers={"authorization": f"Bearer {ALICE}"})
    assert events[-1]["type"] == "response.done", events[-1]
    assert len(audio) > 4096


# ---- ownership -----------------------------------------------------------------------------------

def test_another_key_can_neither_use_list_nor_delete_the_voice(apps: VoicesApps,
                                                               voice: Voice) -> None:
    from websockets.sync.client import connect

    for app in APPS:
        with apps.client(app, BOB) as client:
            assert client.get("/v1/audio/voices").json()["data"] == []
            assert_error(client.get(f"/v1/audio/voices/{voice.id}"), 404, "voice_not_found")
            assert_error(speak(client, voice.id), 404, "voice_not_found")
            assert_error(client.post("/v1/audio/speech", json={
                "model": "tts-1", "voice": voice.id, "input": TEXT}), 404, "voice_not_found")
            assert_error(client.delete(f"/v1/audio/voices/{voice.id}"), 404, "voice_not_found")
        url = apps.base[app].replace("http://", "ws://") + "/v1/audio/speech/stream"
        with connect(url, additional_headers={"authorization": f"Bearer {BOB}"},
                     open_timeout=60) as socket:
            socket.send(json.dumps({"type": "session.start", "voice": voice.id}))
            event = json.loads(socket.recv(timeout=60))
        assert event["type"] == "error" and event["error"]["code"] == "voice_not_found", event
    with apps.client("a") as client:  # still Alice's
        assert [v["id"] for v in client.get("/v1/audio/voices").json()["data"]] == [voice.id]


# ---- refusals ------------------------------------------------------------------------------------

def clip_bytes(samples: np.ndarray, audio_format: str = "WAV", rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples.astype(np.float32), rate, format=audio_format)
    return buffer.getvalue()


def test_bad_uploads_get_a_clear_4xx_reach_no_engine_and_store_nothing(
        apps: VoicesApps, voice: Voice) -> None:
    speech, rate = sf.read(apps.clip_path, dtype="float32")
    long_speech = np.tile(speech, int(31 * rate / len(speech)) + 1)
    files = apps.files()
    embeds = apps.voice_stats("a")["embeds"]
    cases = [
        # (what, form fields, file part or None, status, code, param)
        ("not audio", {}, ("x.wav", b"RIFF, but not really" * 50, "audio/wav"), 400,
         "invalid_audio", "audio_sample"),
        ("silent", {}, ("s.wav", clip_bytes(np.zeros(3 * rate)), "audio/wav"), 400,
         "silent_audio", "audio_sample"),
        ("too short", {}, ("t.wav", clip_bytes(speech[: rate // 2]), "audio/wav"), 400,
         "audio_too_short", "audio_sample"),
        ("too long", {}, ("l.wav", clip_bytes(long_speech), "audio/wav"), 400,
         "audio_too_long", "audio_sample"),
        ("wrong container", {}, ("a.aiff", clip_bytes(speech, "AIFF"), "audio/aiff"), 400,
         "unsupported_audio_format", "audio_sample"),
        ("no consent", {"consent": None}, ("c.wav", apps.clip, "audio/wav"), 400,
         "consent_required", "consent"),
        ("consent refused", {"consent": "false"}, ("c.wav", apps.clip, "audio/wav"), 400,
         "consent_required", "consent"),
        ("no name", {"name": None}, ("c.wav", apps.clip, "audio/wav"), 400,
         "missing_required_parameter", "name"),
        ("blank name", {"name": "   "}, ("c.wav", apps.clip, "audio/wav"), 400,
         "invalid_value", "name"),
        ("no clip", {}, None, 400, "missing_required_parameter", "audio_sample"),
        ("too large", {}, ("big.wav", apps.clip + b"\0" * UPLOAD_LIMIT_BYTES, "audio/wav"), 413,
         "request_too_large", None),
    ]
    with apps.client("a", BOB) as client:
        for what, fields, file_part, status, code, param in cases:
            form = {k: v for k, v in {"name": "Bob", "consent": "true", **fields}.items()
                    if v is not None}
            # (Without the clip, another file part keeps the body multipart.)
            parts = ({"audio_sample": file_part} if file_part
                     else {"unrelated": ("x.txt", b"x", "text/plain")})
            response = client.post("/v1/audio/voices", data=form, files=parts)
            error = assert_error(response, status, code)
            assert error["param"] == param, (what, error)
            assert error["message"], what
        assert_error(client.post("/v1/audio/voices", json={"name": "Bob"}), 415,
                     "unsupported_media_type")
        assert client.get("/v1/audio/voices").json()["data"] == []
    assert apps.files() == files
    assert apps.voice_stats("a")["embeds"] == embeds  # nothing bad reached the engine


def test_a_key_keeps_at_most_max_voices_per_key(apps: VoicesApps, voice: Voice) -> None:
    created = []
    with apps.client("a") as client:
        while len(client.get("/v1/audio/voices").json()["data"]) < MAX_VOICES_PER_KEY:
            response = create(client, apps.clip, name="filler")
            assert response.status_code == 200, response.text
            created.append(response.json()["id"])
        files = apps.files()
        assert_error(create(client, apps.clip, name="one too many"), 409, "voice_limit_reached")
        assert apps.files() == files
        for voice_id in created:
            deleted = client.delete(f"/v1/audio/voices/{voice_id}")
            assert deleted.json() == {"id": voice_id, "object": "audio.voice.deleted",
                                      "deleted": True}
            assert_error(client.delete(f"/v1/audio/voices/{voice_id}"), 404, "voice_not_found")
            assert_error(speak(client, voice_id), 404, "voice_not_found")
    # Deleted means gone from the store: its embeddings and its clip too.
    assert not any(voice_id in path for path in apps.files() for voice_id in created)


# ---- the command line and the page ---------------------------------------------------------------

def run_client(apps: VoicesApps, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve_app.client", *args, "--url",
                           apps.base["b"], "--api-key", BOB], capture_output=True, timeout=300)


def test_the_cli_creates_lists_speaks_with_and_deletes_a_voice(apps: VoicesApps,
                                                                tmp_path: Path) -> None:
    refused = run_client(apps, "voices", "create", str(apps.clip_path), "--name", "Bob")
    assert refused.returncode == 2 and b"--consent" in refused.stderr
    created = run_client(apps, "voices", "create", str(apps.clip_path), "--name", "Bob",
                         "--consent")
    assert created.returncode == 0, created.stderr.decode()
    voice_id = created.stdout.decode().strip()
    listed = run_client(apps, "voices", "list")
    assert listed.returncode == 0 and f"{voice_id}\tBob\t" in listed.stdout.decode()
    out = tmp_path / "bob.wav"
    spoken = subprocess.run([sys.executable, "-m", "serve_app.client", TEXT, "--voice", voice_id,
                             "-o", str(out), "--url", apps.base["b"], "--api-key", BOB, "-q"],
                            capture_output=True, timeout=300)
    assert spoken.returncode == 0, spoken.stderr.decode()
    assert sf.info(out).duration > 0.2
    deleted = run_client(apps, "voices", "delete", voice_id)
    assert deleted.returncode == 0, deleted.stderr.decode()
    gone = run_client(apps, "voices", "delete", voice_id)
    assert gone.returncode == 1 and b"HTTP 404" in gone.stderr


def test_the_page_records_a_voice_from_the_microphone_and_speaks_with_it(
        apps: VoicesApps, tmp_path: Path) -> None:
    if os.environ.get("CI"):
        from playwright import sync_api  # CI installs the test extra: never skip there
    else:
        sync_api = pytest.importorskip("playwright.sync_api")
    executable = chromium_path()
    # Chromium's fake microphone plays this file (in a loop) to getUserMedia.
    microphone = [f"--use-file-for-fake-audio-capture={apps.clip_path}",
                  "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]
    before = apps.voice_stats("b")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=executable, headless=True,
            args=[*CHROMIUM_ARGS, *microphone], viewport={"width": 860, "height": 900})
        try:
            page = browser.new_page()
            page.goto(f"{apps.base['b']}/")
            page.fill("#key", BOB)
            page.dispatch_event("#key", "change")
            page.wait_for_function("document.querySelector('#voice').options.length > 1")
            page.fill("#voice-name", "Recorded")
            page.click("#record")
            page.wait_for_function("window.voiceState.clip !== null", timeout=60_000)
            recorded_s = page.evaluate("window.voiceState.recordedS")
            page.check("#consent")
            page.click("#create-voice")
            page.wait_for_function(
                "window.voiceState.created !== null || window.voiceState.error !== null",
                timeout=120_000)
            created = page.evaluate("[window.voiceState.created, window.voiceState.error]")
            assert created[1] is None, created
            voice_id = created[0]["id"]
            assert page.input_value("#voice") == voice_id  # selected for speaking
            page.select_option("#format", "pcm")
            page.fill("#text", TEXT)
            page.click("#speak")
            page.wait_for_function("window.ttsState.done && window.ttsState.audioS > 0",
                                   timeout=180_000)
            state = page.evaluate("window.ttsState")
            with apps.client("b", BOB) as client:
                listed = [v["id"] for v in client.get("/v1/audio/voices").json()["data"]]
            page.click("#delete-voice")
            page.wait_for_function(f"document.querySelector('#voice').value !== '{voice_id}'")
        finally:
            browser.close()
    assert recorded_s == pytest.approx(5.0, abs=0.01)
    assert state["error"] is None and state["audioS"] > 0.2
    assert voice_id in listed
    after = apps.voice_stats("b")
    assert after["embeds"] == before["embeds"] + 1 and after["loads"] >= before["loads"] + 1
    with apps.client("b", BOB) as client:
        assert client.get("/v1/audio/voices").json()["data"] == []
