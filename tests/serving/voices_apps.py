"""The two voices apps of tests/serving/test_voices_minicpmo.py ("a" and "b", each its own
Ingress and Synthesizer on the tiny MiniCPM-o voice checkpoint, one voice store), what a test
reads them with, and the engine's own audio for a voice (the reference the apps must match)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from serve_app.engines.base import SpeechRequest
from tests.serving.test_minicpmo_app import engine_options

KEYS = ("voices-key-alice", "voices-key-bob")
ALICE, BOB = KEYS
APPS = {"a": "/voices-a", "b": "/voices-b"}
MAX_VOICES_PER_KEY = 2
UPLOAD_LIMIT_BYTES = 2 * 1024 * 1024
CLIP_TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs far away into "
             "the woods.")
TEXT = "Hello in a cloned voice."


def voices_app_args(store: Path, checkpoint: Path, max_engine_voices: int):
    from serve_app.config import ApiConfig

    options = {**engine_options(checkpoint, voices=True), "max_voices": max_engine_voices}
    api = ApiConfig(api_keys=list(KEYS), voice_store=str(store),
                    max_voices_per_key=MAX_VOICES_PER_KEY,
                    max_voice_upload_bytes=UPLOAD_LIMIT_BYTES)
    return options, api


def voices_app(name: str, prefix: str, store: Path, checkpoint: Path, max_engine_voices: int):
    """One of the two apps, to deploy (a ``serve.RunTarget``)."""
    from ray import serve

    from serve_app.config import BatchingConfig
    from serve_app.front.ingress import Ingress
    from serve_app.gpu.synthesizer import Synthesizer

    options, api = voices_app_args(store, checkpoint, max_engine_voices)
    small = {"num_cpus": 0.05}
    synthesizer = Synthesizer.options(
        ray_actor_options=small,
        user_config=BatchingConfig(max_batch_size=4, batch_wait_timeout_s=0.05).model_dump(),
    ).bind("minicpmo", options, voice_store=api.voice_store)
    ingress = Ingress.options(ray_actor_options=small).bind(synthesizer, api.model_dump())
    return serve.RunTarget(ingress, name=name, route_prefix=prefix)


@dataclass
class VoicesApps:
    base: dict[str, str]  # app name -> base URL
    store: Path
    clip: bytes  # real speech, wav
    clip_path: Path
    checkpoint: Path

    def client(self, app: str, key: str = ALICE) -> httpx.Client:
        return httpx.Client(base_url=self.base[app], timeout=300,
                            headers={"authorization": f"Bearer {key}"})

    def synthesizer(self, app: str):
        from ray import serve

        return serve.get_deployment_handle("Synthesizer", app_name=f"voices-{app}")

    def voice_stats(self, app: str) -> dict[str, int]:
        # From a thread of its own: Playwright's sync API runs an event loop in this one.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(
                lambda: self.synthesizer(app).stats.remote().result()["voices"]).result()

    def files(self) -> list[str]:
        return sorted(str(path.relative_to(self.store)) for path in self.store.rglob("*"))


@dataclass
class Voice:
    id: str
    pcm: bytes  # TEXT spoken in it by app a


def create(client: httpx.Client, clip: bytes, name: str = "Alice", **fields) -> httpx.Response:
    form = {"name": name, "consent": "true", **fields}
    return client.post("/v1/audio/voices", data=form,
                       files={"audio_sample": ("speaker.wav", clip, "audio/wav")})


def speak(client: httpx.Client, voice: str, text: str = TEXT) -> httpx.Response:
    return client.post("/v1/speech/stream", json={"text": text, "voice": voice, "format": "pcm",
                                                   "sample_rate": 24000})


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def engine_reference(apps: VoicesApps, voice_id: str) -> tuple[np.ndarray, np.ndarray,
                                                              np.ndarray]:
    """In this process, from the same clip: the engine's embeddings, TEXT in the voice and
    TEXT in the default voice (float samples)."""
    from serve_app.engines.minicpmo import MiniCPMOEngine
    from serve_app.voices.clip import decode_clip

    engine = MiniCPMOEngine.from_options(**engine_options(apps.checkpoint, voices=True))
    try:
        clip = decode_clip(apps.clip, 1.0, 30.0)
        embeddings = engine.embed_voice(clip.samples, clip.sample_rate_hz)
        engine.add_voice(voice_id, embeddings)

        async def run(voice: str) -> np.ndarray:
            (stream,) = engine.submit([SpeechRequest(request_id=voice, text=TEXT, voice=voice)])
            return np.concatenate([chunk.samples async for chunk in stream])

        return embeddings, asyncio.run(run(voice_id)), asyncio.run(run("default"))
    finally:
        engine.close()


def pcm16(samples: np.ndarray) -> np.ndarray:
    return np.round(np.clip(samples, -1.0, 1.0) * 32767).astype(np.int32)


def assert_same_pcm(served: bytes, expected: np.ndarray | bytes) -> None:
    got = np.frombuffer(served, "<i2").astype(np.int32)
    want = (np.frombuffer(expected, "<i2").astype(np.int32) if isinstance(expected, bytes)
            else expected)
    assert len(got) == len(want) > 0
    assert np.max(np.abs(got - want)) <= 1
