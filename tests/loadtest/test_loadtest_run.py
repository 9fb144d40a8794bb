"""scripts/loadtest end to end against a small fake speech server: records, summary, plot, verdict.

The fake streams known audio, so the counted audio seconds are exact; its chat mode answers 503,
so failures must show up in the summary and the exit code.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loadtest import report, run

PIECES = 3
PIECE_SAMPLES = 2400  # 0.1 s at 24 kHz, 0.15 s at 16 kHz


def _fake_app() -> FastAPI:
    app = FastAPI()

    async def pcm_body(header: bytes = b""):
        if header:
            yield header
        for _ in range(PIECES):
            await asyncio.sleep(0.02)
            yield b"\0\0" * PIECE_SAMPLES

    @app.get("/readyz")
    async def readyz() -> dict:
        return {"status": "ready"}

    @app.get("/v1/voices")
    async def voices() -> dict:
        return {"object": "list", "data": [], "modes": ["read", "chat"]}

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> StreamingResponse:
        await request.json()
        return StreamingResponse(pcm_body(), media_type="audio/pcm")

    @app.post("/v1/speech/stream")
    async def native(request: Request):
        body = await request.json()
        if body["mode"] == "chat":
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)
        rate = body["sample_rate"]
        header = (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt "
                  + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
                  + b"data" + struct.pack("<I", 0xFFFFFFFF))
        return StreamingResponse(pcm_body(header), media_type="audio/wav")

    return app


@pytest.fixture(scope="module")
def fake_host() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_fake_app(), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _run(host: str, out: Path, *extra: str) -> tuple[int, dict]:
    code = run.main(["--host", host, "--duration", "3", "--users", "3", "--spawn-rate", "10",
                     "--wait", "0,0.05", "--stop-timeout", "5", "--out", str(out), *extra])
    return code, json.loads((out / "summary.json").read_text())


def test_clean_run_writes_every_artifact_and_exact_audio(fake_host: str, tmp_path: Path) -> None:
    code, summary = _run(fake_host, tmp_path, "--weights", "openai=1,read=1,chat=0")
    assert code == 0
    for name in ("locust.html", "locust_stats.csv", "locust_stats_history.csv",
                 "requests.jsonl", "summary.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert summary["failures"] == 0 and summary["error_rate"] == 0.0
    assert summary["requests"] >= 10 and summary["requests_per_s"] > 0
    assert summary["users"] == 3 and summary["users_max_seen"] == 3
    assert set(summary["by_route"]) == {"/v1/audio/speech", "/v1/speech/stream read"}
    assert 0 < summary["ttfb_ms"]["p50"] <= summary["ttfb_ms"]["p90"] <= summary["ttfb_ms"]["p99"]
    records = report.load_records(tmp_path / "requests.jsonl")
    audio = {r["route"]: r["audio_s"] for r in records if r["ok"]}
    assert audio["/v1/audio/speech"] == pytest.approx(PIECES * PIECE_SAMPLES / 24000)
    assert audio["/v1/speech/stream read"] == pytest.approx(PIECES * PIECE_SAMPLES / 16000)
    # Locust's own table carries the custom metrics under their own request types.
    stats = (tmp_path / "locust_stats.csv").read_text()
    for metric in ("TTFB", "AUDIO", "RTF"):
        assert f"{metric},/v1/audio/speech" in stats


def test_failures_count_and_fail_the_run(fake_host: str, tmp_path: Path) -> None:
    code, summary = _run(fake_host, tmp_path, "--weights", "openai=1,read=0,chat=1")
    assert code == 1
    chat = summary["by_route"]["/v1/speech/stream chat"]
    assert chat["failures"] == chat["requests"] > 0
    assert summary["failures"] == chat["failures"]
    assert 0 < summary["error_rate"] < 1
    assert any("HTTP 503" in sample for sample in summary["failure_samples"])


def test_summary_of_nothing_is_zero_throughput() -> None:
    summary = report.summarize([], host="h", users=1)
    assert summary["requests"] == 0 and summary["requests_per_s"] == 0.0
