"""The command-line client against the real app: files, stdout, the summary it prints, errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from tests.audio.decoding import decode_audio
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

TEXT = "The command line client streams this sentence into a file."
SUMMARY = re.compile(r"TTFB (\d+) ms \| RTF (\d+\.\d+) \| (\d+\.\d+) s of (\w+)")


def run_client(server: Server, *args: str, command: tuple[str, ...] | None = None
               ) -> subprocess.CompletedProcess:
    command = command or (sys.executable, "-m", "serve_app.client")
    return subprocess.run([*command, *args, "--url", server.base_url,
                           "--api-key", server.api_key], capture_output=True, timeout=120)


def test_writes_a_valid_wav_and_prints_ttfb_and_rtf(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "out.wav"
    result = run_client(server, TEXT, "-o", str(out))
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    summary = SUMMARY.search(stderr)
    assert summary, stderr
    ttfb_ms, rtf, audio_s, audio_format = summary.groups()
    assert audio_format == "wav" and 0 < int(ttfb_ms) < 30_000 and float(rtf) > 0
    samples, rate = decode_audio(out.read_bytes(), "wav", 24000)
    assert rate == 24000
    assert len(samples) / rate == pytest.approx(float(audio_s), abs=0.01)
    assert len(samples) / rate > 1.0
    # The live progress line went to stderr, never into the audio.
    assert "KiB" in stderr and "s audio" in stderr


def test_console_script_streams_mp3_to_stdout(server: Server) -> None:
    script = Path(sys.executable).with_name("tts-client")
    assert script.exists(), "the tts-client console script is not installed"
    result = run_client(server, TEXT, "-f", "mp3", "-r", "16000", "-o", "-",
                        command=(str(script),))
    assert result.returncode == 0, result.stderr.decode()
    samples, rate = decode_audio(result.stdout, "mp3", 16000)
    assert rate == 16000 and len(samples) / rate > 1.0
    summary = SUMMARY.search(result.stderr.decode())
    assert summary and summary.group(4) == "mp3"
    assert float(summary.group(3)) == pytest.approx(len(samples) / rate, abs=0.2)


def test_reads_stdin_and_writes_flac(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "speech.flac"
    result = subprocess.run(
        [sys.executable, "-m", "serve_app.client", "-o", str(out), "--url", server.base_url,
         "--api-key", server.api_key, "--quiet"],
        input=TEXT.encode(), capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stderr == b""
    assert sf.info(str(out)).format == "FLAC"
    samples, _ = decode_audio(out.read_bytes(), "flac", 24000)
    assert len(samples) > 24000


def test_refusal_is_reported_with_the_server_message(server: Server, tmp_path: Path) -> None:
    result = run_client(server, TEXT, "--voice", "nobody", "-o", str(tmp_path / "x.wav"))
    assert result.returncode == 1
    assert "HTTP 400" in result.stderr.decode() and "unknown voice" in result.stderr.decode()
