"""Command-line client: stream speech from the service into a file or stdout.

    python -m serve_app.client "Hello there." -o hello.wav
    tts-client "Hello there." -f mp3 -o - | mpv -
    echo "Read from stdin." | tts-client -o out.flac
    tts-client voices create ada.wav --name Ada --consent     # prints the new voice's id
    tts-client voices list
    tts-client "Hello in Ada's voice." --voice voice_... -o ada.wav
    tts-client voices delete voice_...

It posts to the native endpoint (``/v1/speech/stream``), writes each piece as it arrives, keeps a
live progress line on stderr (bytes, seconds of audio, time to first byte) and ends with the time
to first byte (TTFB) and the real-time factor (RTF: wall seconds per second of audio). Audio
seconds are counted live for ``pcm`` and ``wav``; compressed formats are decoded at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

import httpx

from serve_app.audio import FORMATS, SAMPLE_RATES_HZ
from serve_app.audio.decoding import read_stream

DEFAULT_URL = "http://127.0.0.1:8000"
WAV_HEADER_BYTES = 44
PCM_BYTES_PER_SAMPLE = 2
PROGRESS_INTERVAL_S = 0.1


@dataclass
class Result:
    """What one request produced, for the summary line (and callers that import the client)."""

    bytes_written: int
    audio_s: float | None
    ttfb_s: float | None
    total_s: float
    request_id: str | None

    @property
    def rtf(self) -> float | None:
        return self.total_s / self.audio_s if self.audio_s else None


class ClientError(Exception):
    """The service refused the request or could not be reached; the message says why."""


def live_audio_s(audio_format: str, size: int, sample_rate_hz: int) -> float | None:
    """Seconds of audio in the first ``size`` bytes, where the format makes that exact."""
    if audio_format == "pcm":
        return size / PCM_BYTES_PER_SAMPLE / sample_rate_hz
    if audio_format == "wav":
        return max(size - WAV_HEADER_BYTES, 0) / PCM_BYTES_PER_SAMPLE / sample_rate_hz
    return None


def decoded_audio_s(data: bytes) -> float | None:
    """Seconds of audio in a complete mp3/opus/aac/flac stream, by decoding it."""
    try:
        samples, rate = read_stream(data)
    except Exception:  # an undecodable stream just has no duration to report
        return None
    return len(samples) / rate


class Progress:
    """One self-overwriting line on stderr, redrawn at most every PROGRESS_INTERVAL_S."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self._stream = stream
        self._enabled = enabled
        self._drawn_at_s = 0.0
        self._width = 0

    def update(self, size: int, audio_s: float | None, ttfb_s: float | None,
               force: bool = False) -> None:
        now = time.monotonic()
        if not self._enabled or (not force and now - self._drawn_at_s < PROGRESS_INTERVAL_S):
            return
        self._drawn_at_s = now
        parts = [f"{size / 1024:8.1f} KiB"]
        parts.append(f"{audio_s:6.2f} s audio" if audio_s is not None else "  audio …")
        parts.append(f"TTFB {ttfb_s * 1000:.0f} ms" if ttfb_s is not None else "waiting")
        line = " | ".join(parts)
        self._stream.write("\r" + line.ljust(self._width))
        self._stream.flush()
        self._width = len(line)

    def done(self) -> None:
        if self._enabled and self._width:
            self._stream.write("\n")
            self._stream.flush()


def synthesize(url: str, body: dict, sink: BinaryIO, *, api_key: str | None = None,
               timeout_s: float = 300.0, progress: Progress | None = None) -> Result:
    """Stream one request's audio into ``sink``; raises :class:`ClientError` on a refusal."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    audio_format = body["format"]
    sample_rate_hz = body["sample_rate"]
    compressed = live_audio_s(audio_format, 0, sample_rate_hz) is None
    kept = bytearray()
    size = 0
    ttfb_s: float | None = None
    started_s = time.perf_counter()
    try:
        with httpx.Client(base_url=url, timeout=timeout_s) as client, client.stream(
                "POST", "/v1/speech/stream", json=body, headers=headers) as response:
            if response.status_code != 200:
                response.read()
                raise ClientError(f"HTTP {response.status_code}: {_error_message(response)}")
            request_id = response.headers.get("x-request-id")
            for piece in response.iter_raw():
                if not piece:
                    continue
                if ttfb_s is None:
                    ttfb_s = time.perf_counter() - started_s
                sink.write(piece)
                sink.flush()
                size += len(piece)
                if compressed:
                    kept.extend(piece)
                if progress is not None:
                    progress.update(size, live_audio_s(audio_format, size, sample_rate_hz),
                                    ttfb_s)
    except httpx.HTTPError as exc:
        raise ClientError(f"request to {url} failed: {exc}") from exc
    total_s = time.perf_counter() - started_s
    audio_s = decoded_audio_s(bytes(kept)) if compressed else live_audio_s(
        audio_format, size, sample_rate_hz)
    if progress is not None:
        progress.update(size, audio_s, ttfb_s, force=True)
    return Result(bytes_written=size, audio_s=audio_s, ttfb_s=ttfb_s, total_s=total_s,
                  request_id=request_id)


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except Exception:
        return response.text[:200] or response.reason_phrase


def _format_for(output: str, chosen: str | None) -> str:
    if chosen:
        return chosen
    suffix = Path(output).suffix.lower().lstrip(".")
    return {"ogg": "opus", "raw": "pcm"}.get(suffix, suffix) if suffix in (
        *FORMATS, "ogg", "raw") else "wav"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tts-client", description="Stream speech from the serving API to a file or stdout.")
    parser.add_argument("text", nargs="?", default="-",
                        help="text to speak; '-' or nothing reads it from stdin")
    parser.add_argument("-o", "--output", default="-",
                        help="output file; '-' writes to stdout (default)")
    parser.add_argument("--url", "--host", dest="url", default=os.environ.get("TTS_URL",
                                                                             DEFAULT_URL),
                        help=f"service base URL (env TTS_URL; default {DEFAULT_URL})")
    parser.add_argument("-f", "--format", choices=FORMATS,
                        help="audio format (default: from the output's suffix, else wav)")
    parser.add_argument("-m", "--mode", choices=("read", "chat"), default="read",
                        help="read: speak the text; chat: answer it in speech")
    parser.add_argument("-v", "--voice", default="default",
                        help="voice: the engine's (see /v1/voices) or one of yours "
                             "(a voice_... id, see 'tts-client voices list')")
    parser.add_argument("-r", "--sample-rate", type=int, choices=SAMPLE_RATES_HZ, default=24000,
                        help="output sample rate in Hz (default 24000)")
    parser.add_argument("--speed", type=float, default=1.0, help="speaking rate, 0.25-4.0")
    parser.add_argument("--seed", type=int, default=None, help="reproducible output")
    parser.add_argument("--api-key", default=os.environ.get("TTS_API_KEY"),
                        help="bearer key, if the service needs one (env TTS_API_KEY)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress line and no summary")
    return parser.parse_args(argv)


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", "--host", dest="url", default=os.environ.get("TTS_URL",
                                                                             DEFAULT_URL),
                        help=f"service base URL (env TTS_URL; default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=os.environ.get("TTS_API_KEY"),
                        help="bearer key, if the service needs one (env TTS_API_KEY)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")


def parse_voices_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tts-client voices",
        description="Voices cloned from a short clip of someone speaking (engines that clone "
                    "voices only: minicpmo). A voice belongs to the API key that made it.")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create", help="create a voice; prints its id")
    create.add_argument("clip", help="reference clip: wav, flac, ogg or mp3, 1 to 30 s of one "
                                     "person speaking")
    create.add_argument("-n", "--name", help="the voice's name (default: the clip's file name)")
    create.add_argument("--consent", action="store_true",
                        help="required: you attest that the person speaking in the clip "
                             "consented to having their voice cloned")
    commands.add_parser("list", help="your voices: id, name, created")
    delete = commands.add_parser("delete", help="delete one of your voices")
    delete.add_argument("voice_id")
    for command in (create, *(commands.choices[name] for name in ("list", "delete"))):
        _connection_options(command)
    return parser.parse_args(argv)


def voices_main(argv: list[str]) -> int:
    """``tts-client voices create|list|delete``: the voices API from the terminal."""
    args = parse_voices_args(argv)
    if args.command == "create" and not args.consent:
        print("tts-client: creating a voice needs --consent: the person speaking in the clip "
              "must have agreed to having their voice cloned", file=sys.stderr)
        return 2
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with httpx.Client(base_url=args.url, timeout=args.timeout, headers=headers) as client:
            if args.command == "create":
                clip = Path(args.clip)
                try:
                    data = clip.read_bytes()
                except OSError as exc:
                    print(f"tts-client: cannot read {clip}: {exc.strerror}", file=sys.stderr)
                    return 2
                response = client.post("/v1/audio/voices",
                                       data={"name": args.name or clip.stem, "consent": "true"},
                                       files={"audio_sample": (clip.name, data)})
            elif args.command == "list":
                response = client.get("/v1/audio/voices")
            else:
                response = client.delete(f"/v1/audio/voices/{args.voice_id}")
    except httpx.HTTPError as exc:
        print(f"tts-client: request to {args.url} failed: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"tts-client: HTTP {response.status_code}: {_error_message(response)}",
              file=sys.stderr)
        return 1
    body = response.json()
    if args.command == "create":
        print(body["id"])
        print(f"created voice {body['id']} ({body['name']}); speak with --voice {body['id']}",
              file=sys.stderr)
    elif args.command == "list":
        for voice in body["data"]:
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(voice["created_at"]))
            print(f"{voice['id']}\t{voice['name']}\t{created}")
    else:
        print(f"deleted voice {body['id']}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["voices"]:
        return voices_main(argv[1:])
    args = parse_args(argv)
    text = sys.stdin.read() if args.text == "-" else args.text
    if not text.strip():
        print("tts-client: no text to speak", file=sys.stderr)
        return 2
    to_stdout = args.output == "-"
    if to_stdout and sys.stdout.isatty():
        print("tts-client: refusing to write audio to a terminal; use -o FILE or a pipe",
              file=sys.stderr)
        return 2
    body = {"text": text, "mode": args.mode, "voice": args.voice,
            "format": _format_for(args.output, args.format), "sample_rate": args.sample_rate,
            "speed": args.speed}
    if args.seed is not None:
        body["seed"] = args.seed
    progress = Progress(sys.stderr, enabled=not args.quiet)
    sink: BinaryIO = sys.stdout.buffer if to_stdout else open(args.output, "wb")  # noqa: SIM115
    try:
        result = synthesize(args.url, body, sink, api_key=args.api_key, timeout_s=args.timeout,
                            progress=progress)
    except ClientError as exc:
        progress.done()
        print(f"tts-client: {exc}", file=sys.stderr)
        if not to_stdout and sink.tell() == 0:
            sink.close()
            os.unlink(args.output)  # leave no empty file behind a refusal
        return 1
    finally:
        if not to_stdout:
            sink.close()
    progress.done()
    if not args.quiet:
        print(_summary(result, "stdout" if to_stdout else args.output, body["format"]),
              file=sys.stderr)
    return 0


def _summary(result: Result, target: str, audio_format: str) -> str:
    ttfb = f"{result.ttfb_s * 1000:.0f} ms" if result.ttfb_s is not None else "n/a"
    rtf = f"{result.rtf:.3f}" if result.rtf is not None else "n/a"
    audio = f"{result.audio_s:.2f} s" if result.audio_s is not None else "unknown length"
    return (f"TTFB {ttfb} | RTF {rtf} | {audio} of {audio_format} in {result.total_s:.2f} s | "
            f"{result.bytes_written} bytes -> {target}")


if __name__ == "__main__":
    sys.exit(main())
