"""A LiveKit Agents TTS that speaks through ``WS /v1/audio/speech/stream``.

:class:`SpeechStreamTTS` is a ``livekit.agents.tts.TTS`` that streams (``streaming=True``) and
times its words (``aligned_transcript=True``): give it to an ``AgentSession`` as its ``tts``
(with ``use_tts_aligned_transcript=True`` the agent's transcript follows these times). Each
``stream()`` is one WebSocket session: the text pushed goes in as it comes
(``input_text.delta``), the end of the input (or a flush: one segment per stream) ends it
(``input_text.done``), and the audio comes back with each word as a ``TimedString`` (start and
end in seconds from the segment's first sample). Closing the stream closes the socket, which
stops the synthesis at once. ``synthesize()`` runs one stream over a whole text.

Run as a script, it streams the words of a text file in at an LLM's pace, writes the audio
(raw PCM, s16le mono) and prints each word with its times:

    python examples/livekit_tts.py --url ws://localhost:8000/v1/audio/speech/stream \\
        --text-file speech.txt --out livekit.pcm [--api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from livekit.agents import (
    DEFAULT_API_CONNECT_OPTIONS,
    APIConnectionError,
    APIConnectOptions,
    APIError,
    APIStatusError,
    APITimeoutError,
    tts,
    utils,
)
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.agents.voice.io import TimedString
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

# The most text one input_text.delta may carry (the service's api.max_text_delta_chars default).
MAX_DELTA_CHARS = 1000


class SpeechStreamTTS(tts.TTS):
    """LiveKit Agents TTS over ``WS /v1/audio/speech/stream``, with word timestamps."""

    def __init__(self, *, url: str, api_key: str | None = None, voice: str = "alloy",
                 sample_rate: int = 24000) -> None:
        """Args:
            url: The service's ``ws://.../v1/audio/speech/stream``.
            api_key: Sent as ``Authorization: Bearer``, where the service has keys.
            voice: A voice of the service (OpenAI's names are aliases).
            sample_rate: Of the audio asked for (8000, 16000, 22050, 24000, 44100, 48000).
        """
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
                         sample_rate=sample_rate, num_channels=1)
        self.url = url
        self.api_key = api_key
        self.voice = voice

    def synthesize(self, text: str, *,
                   conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
                   ) -> tts.ChunkedStream:
        return self._synthesize_with_stream(text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
               ) -> SpeechStreamSynthesizeStream:
        return SpeechStreamSynthesizeStream(tts=self, conn_options=conn_options)


class SpeechStreamSynthesizeStream(tts.SynthesizeStream):
    """One WebSocket session: the text pushed in, the audio and its words out."""

    def __init__(self, *, tts: SpeechStreamTTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._speech: SpeechStreamTTS = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(),
                                  sample_rate=self._speech.sample_rate, num_channels=1,
                                  mime_type="audio/pcm", stream=True)
        headers = ({"Authorization": f"Bearer {self._speech.api_key}"}
                   if self._speech.api_key else {})
        timeout = self._conn_options.timeout
        try:
            async with connect(self._speech.url, additional_headers=headers, max_size=None,
                               open_timeout=timeout) as socket:
                await socket.send(json.dumps({
                    "type": "session.start", "voice": self._speech.voice,
                    "response_format": "pcm", "sample_rate": self._speech.sample_rate,
                    "timestamp_granularities": ["word"]}))
                reply = json.loads(await asyncio.wait_for(socket.recv(), timeout))
                if reply.get("type") != "session.started":
                    error = reply.get("error") or {}
                    raise APIStatusError(f"session refused: {error.get('message', reply)}",
                                         body=reply, retryable=False)
                output_emitter.start_segment(segment_id=reply["session_id"])
                tasks = [asyncio.create_task(self._send_text(socket)),
                         asyncio.create_task(self._receive_audio(socket, output_emitter))]
                try:
                    await asyncio.gather(*tasks)
                finally:
                    await utils.aio.gracefully_cancel(*tasks)
        except APIError:
            raise
        except asyncio.TimeoutError:
            raise APITimeoutError() from None
        except (OSError, WebSocketException) as e:
            raise APIConnectionError(f"speech stream: {e}") from e

    async def _send_text(self, socket: ClientConnection) -> None:
        """The text as it is pushed; ``input_text.done`` at a flush or the end of input."""
        async for data in self._input_ch:
            if isinstance(data, self._FlushSentinel):
                break  # one segment per stream: a flush ends its text
            self._mark_started()
            for start in range(0, len(data), MAX_DELTA_CHARS):
                await socket.send(json.dumps({"type": "input_text.delta",
                                              "delta": data[start:start + MAX_DELTA_CHARS]}))
        await socket.send(json.dumps({"type": "input_text.done"}))

    async def _receive_audio(self, socket: ClientConnection,
                             output_emitter: tts.AudioEmitter) -> None:
        """Audio and words until ``response.done``."""
        words: list[dict] = []  # of the audio.chunk event whose bytes come next
        async for message in socket:
            if isinstance(message, bytes):
                # The words whose audio starts in this chunk, each with the space after it, so
                # the transcript's pieces join into the text.
                output_emitter.push_timed_transcript([
                    TimedString(text=word["word"] + " ", start_time=word["start"],
                                end_time=word["end"]) for word in words])
                output_emitter.push(message)
                words = []
                continue
            event = json.loads(message)
            kind = event.get("type")
            if kind == "audio.chunk":
                words = event.get("words") or []
            elif kind == "response.done":
                output_emitter.end_input()
                return
            elif kind == "error":
                error = event.get("error") or {}
                raise APIError(f"speech stream: {error.get('message', event)}", body=event,
                               retryable=False)
        raise APIConnectionError("the speech stream closed before response.done")


async def speak(args: argparse.Namespace) -> None:
    words = Path(args.text_file).read_text(encoding="utf-8").split()
    speech = SpeechStreamTTS(url=args.url, api_key=args.api_key, voice=args.voice,
                             sample_rate=args.sample_rate)
    audio_s = 0.0
    async with speech.stream() as stream:

        async def type_words() -> None:
            for index, word in enumerate(words):
                stream.push_text(word if index == 0 else " " + word)
                await asyncio.sleep(1.0 / args.words_per_s)
            stream.end_input()

        typing = asyncio.create_task(type_words())
        with open(args.out, "wb") as out:
            async for audio in stream:
                out.write(audio.frame.data.tobytes())
                audio_s += audio.frame.duration
                for word in audio.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []):
                    print(f"[{word.start_time:6.2f} - {word.end_time:6.2f} s] {word.strip()}")
        await typing
    print(f"{audio_s:.2f} s of audio at {speech.sample_rate} Hz -> {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://localhost:8000/v1/audio/speech/stream")
    parser.add_argument("--text-file", required=True)
    parser.add_argument("--words-per-s", type=float, default=8.0,
                        help="the LLM's pace (an LLM streams about 5-15 words per second)")
    parser.add_argument("--voice", default="alloy")
    parser.add_argument("--sample-rate", type=int, default=24000)
    parser.add_argument("--api-key")
    parser.add_argument("--out", default="livekit.pcm", help="raw PCM, s16le mono")
    asyncio.run(speak(parser.parse_args()))


if __name__ == "__main__":
    main()
