"""bench_serve's server-sent-event streams (``--sse``, ``--word-timestamps``, what
scripts/bench_timestamps compares) against the real app over HTTP: Locust's streams ask for what
the option says, their events carry words only when asked, and TTFB is the first audio's."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.served.arrivals import READ_TEXT, stream_request
from bench.served.config import parse_args
from bench.served.measure import run_level
from loadtest.report import load_records
from loadtest.sse_audio import SseAudio

pytestmark = pytest.mark.slow


def level_of_two(server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *options: str
                 ) -> tuple[dict, list[dict]]:
    """Two read streams at once (a burst) as bench_serve runs a level: its row and Locust's
    record of each stream."""
    monkeypatch.setenv("LOADTEST_API_KEY", server.api_key)  # Locust's streams carry the key
    args = parse_args(["--modes", "read", "--read-levels", "2", "--arrivals", "burst",
                       "--log", str(tmp_path / "no-service-log"), *options])
    row = run_level(server.base_url, "read", 2, "burst", args, tmp_path)
    [records] = [load_records(path) for path in tmp_path.glob("*.jsonl")]
    return row, records


@pytest.mark.timeout(600)
def test_word_timestamps_streams_carry_every_word_and_time_the_first_audio(
        server, tmp_path, monkeypatch) -> None:
    row, records = level_of_two(server, tmp_path, monkeypatch, "--word-timestamps")

    assert row["route"] == "/v1/audio/speech sse words"
    assert row["completed"] == 2 and row["failures"] == 0 and not row["errors"]
    assert row["streams_with_words"] == 2
    # Every word of the text is timed once (the words, joined, give back the text).
    assert row["words_per_stream_p50"] == len(READ_TEXT.split())
    assert row["ttfb_ms_p50"] is not None and row["ttfb_ms_p50"] > 0
    for record in records:
        assert record["ok"] and record["route"] == row["route"]
        assert record["words"] == len(READ_TEXT.split())
        assert 0 < record["ttfb_s"] <= record["total_s"]
        # The audio counted is the events' decoded pcm (24 kHz, 16 bit), not the event text.
        assert record["bytes"] == round(record["audio_s"] * 48000) and record["audio_s"] > 1


@pytest.mark.timeout(600)
def test_sse_without_timestamps_is_the_same_stream_without_words(
        server, tmp_path, monkeypatch) -> None:
    row, records = level_of_two(server, tmp_path, monkeypatch, "--sse")

    assert row["route"] == "/v1/audio/speech sse"
    assert row["completed"] == 2 and row["failures"] == 0
    assert row["streams_with_words"] == 0 and row["words_per_stream_p50"] == 0
    assert row["ttfb_ms_p50"] is not None and row["ttfb_ms_p50"] > 0
    assert all(record["ok"] and record["words"] == 0 for record in records)


def test_the_two_arms_differ_in_word_timestamps_only() -> None:
    off = stream_request("read", parse_args(["--modes", "read", "--sse"]))
    on = stream_request("read", parse_args(["--modes", "read", "--word-timestamps"]))
    assert off[0] == on[0] == "/v1/audio/speech"
    assert {**off[1], "timestamp_granularities": ["word"]} == on[1]
    with pytest.raises(SystemExit):  # OpenAI's route reads only
        parse_args(["--modes", "read", "chat", "--sse"])


def test_events_split_anywhere_give_the_plain_streams_audio(client: httpx.Client) -> None:
    """The reader's audio from a real event stream, fed in pieces that cut events (and their
    base64) anywhere, is the plain pcm stream of the same request (seeded: Piper is then
    noise-free), and it counts the words and the done event."""
    body = {"model": "tts-1", "voice": "alloy", "input": READ_TEXT, "response_format": "pcm",
            "seed": 3}
    plain = client.post("/v1/audio/speech", json=body)
    events = client.post("/v1/audio/speech", json={**body, "stream_format": "sse",
                                                   "timestamp_granularities": ["word"]})
    assert plain.status_code == events.status_code == 200
    deltas = [json.loads(line[len("data: "):]) for line in events.text.splitlines()
              if line.startswith("data: ")]

    reader = SseAudio()
    raw = events.content
    pieces, start = [], 0
    for size in np.random.default_rng(0).integers(1, 700, size=len(raw)):
        if start >= len(raw):
            break
        pieces.append(reader.audio_of(raw[start:start + int(size)]))
        start += int(size)
    assert b"".join(pieces) == plain.content
    assert reader.done and reader.failure() is None
    assert reader.words == len(READ_TEXT.split()) == sum(len(d.get("words", ())) for d in deltas)
    assert reader.events == sum(d["type"] == "speech.audio.delta" for d in deltas)
