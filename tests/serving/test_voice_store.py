"""The voice store and the clip checks, without Ray: formats, refusals, ownership, atomicity."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from serve_app.engines.base import InvalidRequestError
from serve_app.front.guard import KeyRing
from serve_app.voices.clip import SHARED_OWNER, Clip, check_name, decode_clip, is_voice_id, owner_of_key
from serve_app.voices.store import VoiceLimitReached, VoiceNotFound, VoiceStore

RATE_HZ = 16000
KEY = "secret-key-for-the-store-test"


def speechlike(seconds: float, rate: int = RATE_HZ, channels: int = 1) -> np.ndarray:
    """A voiced, syllable-paced signal: harmonics of a gliding pitch under a 4 Hz envelope."""
    t = np.arange(int(seconds * rate)) / rate
    pitch = 120 + 30 * np.sin(2 * np.pi * 0.5 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 4 * t))
    mono = (0.3 * voiced * envelope).astype(np.float32)
    return np.stack([mono, 0.5 * mono], axis=1) if channels == 2 else mono


def encoded(samples: np.ndarray, audio_format: str, rate: int = RATE_HZ, **kw) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=audio_format, **kw)
    return buffer.getvalue()


def refusal(data: bytes, min_s: float = 1.0, max_s: float = 30.0) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as error:
        decode_clip(data, min_s, max_s)
    assert error.value.param == "audio_sample"
    return error.value


@pytest.mark.parametrize(("audio_format", "extra"), [
    ("WAV", {"subtype": "PCM_16"}), ("WAV", {"subtype": "FLOAT"}), ("FLAC", {}),
    ("OGG", {"subtype": "VORBIS"}), ("OGG", {"subtype": "OPUS"}), ("MP3", {})])
def test_every_container_decodes_to_mono_of_its_length(audio_format: str, extra: dict) -> None:
    rate = 48000 if extra.get("subtype") == "OPUS" else RATE_HZ
    source = speechlike(3.0, rate, channels=2)
    clip = decode_clip(encoded(source, audio_format, rate, **extra), 1.0, 30.0)
    assert clip.samples.ndim == 1 and clip.samples.dtype == np.float32
    assert clip.sample_rate_hz == rate
    assert clip.seconds == pytest.approx(3.0, abs=0.1)  # codecs pad a little
    assert np.abs(clip.samples).max() <= 1.0


def test_bad_clips_are_refused_with_a_code_that_says_why() -> None:
    assert refusal(b"").code == "invalid_audio"
    assert refusal(b"this is not audio at all" * 100).code == "invalid_audio"
    assert refusal(encoded(speechlike(3.0), "AIFF")).code == "unsupported_audio_format"
    assert refusal(encoded(np.zeros(RATE_HZ * 3, np.float32), "WAV")).code == "silent_audio"
    assert refusal(encoded(speechlike(0.5), "WAV")).code == "audio_too_short"
    assert refusal(encoded(speechlike(31.0), "FLAC")).code == "audio_too_long"
    noisy = speechlike(3.0)
    noisy[100] = np.nan
    assert refusal(encoded(noisy, "WAV", subtype="FLOAT")).code == "invalid_audio"
    assert refusal(encoded(speechlike(3.0, 4000), "WAV", 4000)).code == "unsupported_sample_rate"
    truncated = encoded(speechlike(3.0), "FLAC")[:300]
    assert refusal(truncated).code in ("invalid_audio", "audio_too_short")


def test_a_stream_without_a_length_is_still_held_to_the_limit() -> None:
    # A FLAC whose header says "length unknown" (as a streaming encoder leaves it; this
    # service's own flac carries its length): decoding stops at the limit instead of unpacking
    # all of it.
    from serve_app.audio.encoding import StreamEncoder

    encoder = StreamEncoder("flac", RATE_HZ, RATE_HZ)
    data = encoder.encode(speechlike(40.0)) + encoder.finish()
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first
    total_samples = slice(8 + 13, 8 + 18)  # its low 36 bits (after rate, channels, bits)
    header = int.from_bytes(data[total_samples], "big") & ~((1 << 36) - 1)
    unknown_length = data[:total_samples.start] + header.to_bytes(5, "big") + data[
        total_samples.stop:]
    with pytest.raises(ValueError):  # what libsndfile does with it (serve_app/audio/encoding.py)
        sf.read(io.BytesIO(unknown_length))
    assert refusal(unknown_length).code == "audio_too_long"


def test_names_are_trimmed_and_bounded() -> None:
    assert check_name("  Ada  ") == "Ada"
    for bad in ("", "   ", "x" * 257, "a\x00b", "line\nbreak"):
        with pytest.raises(InvalidRequestError) as error:
            check_name(bad)
        assert error.value.param == "name"


def test_owners_are_hashes_of_keys_and_the_key_ring_names_them() -> None:
    ring = KeyRing([KEY, "another-key"])
    assert ring.owner(ring.authenticate(f"Bearer {KEY}")) == owner_of_key(KEY)
    assert ring.owner(ring.authenticate("Bearer another-key")) == owner_of_key("another-key")
    assert owner_of_key(KEY) != owner_of_key("another-key")
    assert KEY not in owner_of_key(KEY) and len(owner_of_key(KEY)) == 32
    assert KeyRing([]).owner(None) == SHARED_OWNER


def make_clip(seconds: float = 2.0) -> Clip:
    return Clip(speechlike(seconds), RATE_HZ, "wav")


def embeddings(frames: int = 50, hidden: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((frames, hidden)).astype(np.float32)


def create(store: VoiceStore, owner: str, name: str = "Ada", seed: int = 0, **kw):
    return store.create(owner, name, make_clip(), embeddings(seed=seed),
                        consent={"attested": True}, model_id="tiny", **kw)


def test_a_voice_round_trips_and_belongs_to_its_owner_only(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path / "voices")
    mine, theirs = owner_of_key(KEY), owner_of_key("another-key")
    assert store.list(mine) == [] and store.count(mine) == 0
    record = create(store, mine)
    assert is_voice_id(record.id)
    assert record.public() == {"id": record.id, "object": "audio.voice", "name": "Ada",
                               "created_at": record.created_at}
    assert store.get(mine, record.id) == record
    assert [r.id for r in store.list(mine)] == [record.id]
    np.testing.assert_array_equal(store.embeddings(record.id), embeddings())
    samples, rate = store.clip(mine, record.id)
    assert rate == RATE_HZ and np.max(np.abs(samples - make_clip().samples)) < 1e-4
    # Another owner sees nothing, and cannot delete it.
    assert store.list(theirs) == []
    with pytest.raises(VoiceNotFound):
        store.get(theirs, record.id)
    with pytest.raises(VoiceNotFound):
        store.delete(theirs, record.id)
    # The key is nowhere in the store; its hash names the owner.
    for path in (tmp_path / "voices").rglob("*"):
        assert KEY not in str(path)
        if path.is_file():
            assert KEY.encode() not in path.read_bytes()
    store.delete(mine, record.id)
    assert store.list(mine) == []
    with pytest.raises(VoiceNotFound):
        store.embeddings(record.id)
    with pytest.raises(VoiceNotFound):
        store.delete(mine, record.id)


def test_ids_that_are_not_voice_ids_never_reach_the_filesystem(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    create(store, SHARED_OWNER)
    for bad in ("../shared", "voice_../../etc", "voice_" + "0" * 23, ".incoming", "voice_X" * 4):
        with pytest.raises(VoiceNotFound):
            store.get(SHARED_OWNER, bad)
        with pytest.raises(VoiceNotFound):
            store.embeddings(bad)
        with pytest.raises(VoiceNotFound):
            store.delete(SHARED_OWNER, bad)


def test_the_limit_counts_the_owners_voices(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    for seed in range(2):
        create(store, SHARED_OWNER, seed=seed, max_voices=2)
    with pytest.raises(VoiceLimitReached):
        create(store, SHARED_OWNER, max_voices=2)
    assert store.count(SHARED_OWNER) == 2
    create(store, owner_of_key(KEY), max_voices=2)  # another owner has its own count
    # Nothing half-written was left behind by the refusal.
    assert not list((tmp_path / SHARED_OWNER / ".incoming").iterdir())


def test_readers_never_see_a_half_written_or_half_deleted_voice(tmp_path: Path) -> None:
    writer_store, reader_store = VoiceStore(tmp_path), VoiceStore(tmp_path)
    big = (400, 256)  # ~400 KB of embeddings: writing it takes a while
    stop = threading.Event()
    seen: list[int] = []
    problems: list[str] = []

    def read() -> None:
        while not stop.is_set():
            for record in reader_store.list(SHARED_OWNER):
                try:
                    values = reader_store.embeddings(record.id)
                except VoiceNotFound:
                    continue  # deleted between the listing and the read: fine
                if values.shape != big or not np.isfinite(values).all():
                    problems.append(f"{record.id}: {values.shape}")
                seen.append(1)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers:
        thread.start()
    try:
        for seed in range(20):
            record = writer_store.create(SHARED_OWNER, f"v{seed}", make_clip(),
                                         embeddings(*big, seed=seed),
                                         consent={"attested": True}, model_id="tiny")
            if seed % 2:
                writer_store.delete(SHARED_OWNER, record.id)
    finally:
        stop.set()
        for thread in readers:
            thread.join()
    assert not problems, problems
    assert seen and writer_store.count(SHARED_OWNER) == 10
