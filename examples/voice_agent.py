"""A voice agent's side of ``WS /v1/audio/speech/stream``: stream words in, save the audio.

An LLM streams its answer token by token; here the words of a text file stand in for those
tokens, sent at a typing pace. Audio frames are written to ``--out`` as they arrive (raw bytes in
the asked format: ``pcm`` is s16le mono at ``--sample-rate``), and the script prints the time to
first audio measured from the first word sent, then the captions (the text each chunk speaks;
with ``--words``, each word at its start time).

``--barge-in-s S`` plays the user who cuts in: once S seconds of audio have arrived (standing in
for S seconds played) it sends ``cancel`` with ``played_s`` and prints the ``spoken_text`` the
service answers with: the words heard, which an agent keeps in its history.

    python examples/voice_agent.py --url ws://localhost:8000/v1/audio/speech/stream \\
        --text-file /tmp/speech.txt --words-per-s 8 --out /tmp/agent.pcm [--api-key KEY] \\
        [--words] [--barge-in-s 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from websockets.asyncio.client import connect


async def type_words(socket, words: list[str], words_per_s: float, started: dict) -> None:
    """Send one word per delta at the typing pace, then input_text.done."""
    for index, word in enumerate(words):
        await socket.send(json.dumps({"type": "input_text.delta",
                                      "delta": word if index == 0 else " " + word}))
        started.setdefault("first_word_s", time.perf_counter())
        await asyncio.sleep(1.0 / words_per_s)
    await socket.send(json.dumps({"type": "input_text.done"}))


async def run(args: argparse.Namespace) -> None:
    words = Path(args.text_file).read_text(encoding="utf-8").split()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    started: dict[str, float] = {}
    audio_bytes = 0
    async with connect(args.url, additional_headers=headers, max_size=None) as socket:
        start = {"type": "session.start", "voice": args.voice, "response_format": args.format,
                 "sample_rate": args.sample_rate}
        if args.words or args.barge_in_s is not None:
            start["timestamp_granularities"] = ["word"]
        await socket.send(json.dumps(start))
        opened = json.loads(await socket.recv())
        if opened["type"] != "session.started":
            raise SystemExit(f"session refused: {opened}")
        typing = asyncio.create_task(type_words(socket, words, args.words_per_s, started))
        with open(args.out, "wb") as out:
            async for message in socket:
                if isinstance(message, bytes):
                    if not audio_bytes:
                        ttfb_ms = (time.perf_counter() - started["first_word_s"]) * 1000
                        print(f"first audio {ttfb_ms:.0f} ms after the first word was sent")
                    audio_bytes += len(message)
                    out.write(message)
                    continue
                event = json.loads(message)
                if event["type"] == "audio.chunk":
                    if args.words:
                        for word in event["words"]:
                            print(f"[{word['start']:7.2f} s] {word['word']}")
                    elif event["text"]:
                        print(f"[{event['audio_offset_s']:7.2f} s] {event['text']}")
                    arrived_s = event["audio_offset_s"] + event["duration_s"]
                    if args.barge_in_s is not None and arrived_s >= args.barge_in_s:
                        await socket.send(json.dumps({"type": "cancel",
                                                      "played_s": args.barge_in_s}))
                        args.barge_in_s = None  # once
                elif event["type"] == "response.cancelled":
                    print(f"cut in after {event.get('played_s')} s; heard: "
                          f"{event.get('spoken_text')!r}")
                elif event["type"] == "response.done":
                    print(f"done: {audio_bytes} bytes of audio, usage {event['usage']}")
                elif event["type"] == "error":
                    print(f"error: {event['error']}")
        typing.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://localhost:8000/v1/audio/speech/stream")
    parser.add_argument("--text-file", required=True)
    parser.add_argument("--words-per-s", type=float, default=8.0,
                        help="typing pace (an LLM streams about 5-15 words per second)")
    parser.add_argument("--voice", default="alloy")
    parser.add_argument("--format", default="pcm",
                        choices=["pcm", "wav", "mp3", "opus", "aac", "flac"])
    parser.add_argument("--sample-rate", type=int, default=24000)
    parser.add_argument("--api-key")
    parser.add_argument("--out", default="agent.pcm")
    parser.add_argument("--words", action="store_true",
                        help="ask for word timestamps and print each word at its start")
    parser.add_argument("--barge-in-s", type=float,
                        help="cancel once this much audio has arrived; print what was heard")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
