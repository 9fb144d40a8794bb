"""A Pipecat TTS service that speaks through ``WS /v1/audio/speech/stream``.

:class:`SpeechStreamTTSService` is a Pipecat 1.14 ``WebsocketTTSService``: put it in a pipeline
where any other TTS service goes. Each bot turn is one WebSocket session: the LLM's text goes in
as it is written (``input_text.delta``, a sentence at a time by default), the audio comes back
with each word's start time, and those times become the times of the turn's ``TTSTextFrame`` s
(``add_word_timestamps``), moved by any wait the listener had for the audio (text that came
slower than speech). The output transport releases a word when its audio plays, so a turn cut
short keeps only the words the user heard. On the interruption the open session gets
``cancel`` with ``played_s``, the seconds of its audio played by then: the service stops
synthesizing and answers with ``spoken_text``, the words heard in full (the
``on_speech_cancelled`` event); the turn may also keep the word being spoken at the cut. The
time played is reckoned as Pipecat reckons its word times: the audio plays from when it
arrives, one chunk after another.

``text_aggregation_mode=TextAggregationMode.TOKEN`` sends each token as it comes (the service
cuts streamed text at clause ends itself), so the first audio comes sooner; but Pipecat 1.14
holds a sentence's timed words until the sentence is complete, so a turn interrupted while the
LLM is still writing a sentence loses that sentence's heard words from the context.

Run as a script, it plays an LLM's answer (the words of a text file, typed at an LLM's pace)
through a pipeline of the service, :class:`PcmFileOutputTransport` (a speaker that plays into a
raw PCM file, s16le mono, in real time) and an assistant context aggregator, then prints the
bot's turn as the context keeps it. ``--barge-in-s S`` cuts in once S seconds have played, as a
user would, and also prints what the service says was heard.

    python examples/pipecat_tts.py --url ws://localhost:8000/v1/audio/speech/stream \\
        --text-file speech.txt --out pipecat.pcm [--api-key KEY] [--barge-in-s 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path

from loguru import logger
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    OutputAudioRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, WebsocketTTSService
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams
from pipecat.workers.runner import WorkerRunner
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

# The most text one input_text.delta may carry (the service's api.max_text_delta_chars default).
MAX_DELTA_CHARS = 1000
# How long a new session may take to answer session.start (the service opens its stream first).
SESSION_START_TIMEOUT_S = 60.0


class SpeechStreamTTSService(WebsocketTTSService):
    """Pipecat TTS over ``WS /v1/audio/speech/stream``, with word timestamps.

    One session per audio context (a bot turn, or a ``TTSSpeakFrame``), opened when its first
    text arrives and ended with ``input_text.done`` when the turn ends. The frames after a turn
    wait until its audio has arrived (``pause_frame_processing``), so sessions run one at a time.

    Event handlers:
        on_speech_cancelled(service, played_s, spoken_text): the service's answer to the
            ``cancel`` an interruption sent: the seconds of audio played and the words heard.
    """

    def __init__(
        self,
        *,
        url: str,
        api_key: str | None = None,
        voice: str = "alloy",
        sample_rate: int | None = None,
        text_aggregation_mode: TextAggregationMode = TextAggregationMode.SENTENCE,
        stop_frame_timeout_s: float = 20.0,
        **kwargs,
    ):
        """Args:
            url: The service's ``ws://.../v1/audio/speech/stream``.
            api_key: Sent as ``Authorization: Bearer``, where the service has keys.
            voice: A voice of the service (OpenAI's names are aliases).
            sample_rate: Of the audio asked for (8000, 16000, 22050, 24000, 44100, 48000);
                None takes the pipeline's output rate.
            text_aggregation_mode: ``SENTENCE`` (default) sends each sentence once the LLM
                has written it; ``TOKEN`` sends tokens as they come (see the module docstring).
            stop_frame_timeout_s: How long a turn's audio context waits for more audio before
                Pipecat ends it (3 s in Pipecat). A session ends its turn itself
                (``response.done``), so this only bounds a wait; by default the service's own
                idle limit (``api.ws_idle_timeout_s``), so that a slow first audio or a pause
                of the LLM's does not end the turn early.
        """
        super().__init__(
            text_aggregation_mode=text_aggregation_mode,
            # The words come back timed (add_word_timestamps), not as the text sent.
            push_text_frames=False,
            push_start_frame=True,
            push_stop_frames=True,
            pause_frame_processing=True,
            # Sentences (SENTENCE mode) are sent one after another into one session's text.
            append_trailing_space=True,
            # A session cannot be resumed: the next text opens a new one.
            reconnect_on_error=False,
            stop_frame_timeout_s=stop_frame_timeout_s,
            sample_rate=sample_rate,
            settings=TTSSettings(model=None, voice=voice, language=None),
            **kwargs,
        )
        self._url = url
        self._api_key = api_key
        self._receive_task: asyncio.Task | None = None
        # The audio context the open session speaks, and what is known of the session.
        self._session_context_id: str | None = None
        self._input_done = False
        self._session_answered = False  # response.done or response.cancelled came
        # When the listener hears the audio (the pipeline clock, ns): chunks play back to back
        # in real time from when they arrive. Where the audio arrived so far ends; the audio
        # context whose words are being timed and where its first chunk starts (Pipecat times
        # a context's words from there); the open session's chunks (start, duration) and the
        # seconds of its stream received.
        self._playout_end_ns = 0
        self._timed_context_id: str | None = None
        self._context_origin_ns = 0
        self._session_playout: list[tuple[int, int]] = []
        self._session_stream_s = 0.0
        self._register_event_handler("on_speech_cancelled")

    def can_generate_metrics(self) -> bool:
        return True

    # ---- text in ---------------------------------------------------------------------------

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Send ``text`` into the session of ``context_id`` (opened on its first text); the
        audio arrives on the receive task."""
        if context_id != self._session_context_id or not self._session_open():
            await self._end_session()
            await self._open_session(context_id)
            if not self._session_open():
                return  # refused: the error is reported (push_error)
        try:
            for start in range(0, len(text), MAX_DELTA_CHARS):
                delta = text[start:start + MAX_DELTA_CHARS]
                await self._get_websocket().send(
                    json.dumps({"type": "input_text.delta", "delta": delta}))
        except Exception as e:
            yield ErrorFrame(error=f"{self}: text not sent: {e}")
            return
        await self.start_tts_usage_metrics(text)
        yield None

    async def flush_audio(self, context_id: str | None = None):
        """The turn's text is complete: ``input_text.done`` (the service speaks the rest)."""
        if context_id in (None, self._session_context_id):
            await self._end_input()

    async def on_turn_context_completed(self):
        completing = self._turn_context_id
        # Flushes the turn when its audio context is open.
        await super().on_turn_context_completed()
        # Also when the context went quiet (no audio for stop_frame_timeout_s) and was closed
        # before the turn's end: the session still waits for the end of its text.
        if completing is not None and completing == self._session_context_id:
            await self._end_input()

    async def _end_input(self):
        if self._input_done or not self._session_open():
            return
        self._input_done = True
        try:
            await self._get_websocket().send(json.dumps({"type": "input_text.done"}))
        except ConnectionClosed:
            pass

    # ---- the listener's timeline, interruptions --------------------------------------------

    def _place_chunk(self, context_id: str, duration_s: float) -> float:
        """Put a chunk of the session's audio on the listener's timeline; returns where it
        starts, in seconds from the audio context's first chunk."""
        now = self.get_clock().get_time()
        start = max(now, self._playout_end_ns)  # after a gap (the text came slower than
        self._playout_end_ns = start + int(duration_s * 1e9)  # speech) the listener waited
        if context_id != self._timed_context_id or not self.audio_context_available(context_id):
            self._timed_context_id = context_id  # the context's first chunk (or it reopened:
            self._context_origin_ns = start  # Pipecat closes one that stays quiet a while)
        self._session_playout.append((start, int(duration_s * 1e9)))
        return (start - self._context_origin_ns) / 1e9

    def _played_s(self) -> float:
        """Seconds of the open session's audio the listener has heard by now."""
        now = self.get_clock().get_time()
        return sum(min(max(now - start, 0), duration)
                   for start, duration in self._session_playout) / 1e9

    async def _handle_interruption(self, frame: InterruptionFrame, direction: FrameDirection):
        played_s = self._played_s()
        await super()._handle_interruption(frame, direction)
        self._playout_end_ns = 0  # the transport drops what it had not played
        # The session's context was dropped (or had gone quiet and closed): stop the session,
        # saying how much of it was heard.
        if (self._session_context_id is not None
                and self._session_context_id not in self.get_audio_contexts()):
            await self._cancel_session(played_s)

    async def _cancel_session(self, played_s: float):
        if self._session_answered or not self._session_open():
            return
        self._input_done = True
        try:
            await self._get_websocket().send(
                json.dumps({"type": "cancel", "played_s": round(played_s, 3)}))
        except ConnectionClosed:
            pass

    # ---- sessions --------------------------------------------------------------------------

    def _session_open(self) -> bool:
        return self._websocket is not None and self._websocket.state is State.OPEN

    def _get_websocket(self):
        if self._websocket:
            return self._websocket
        raise ConnectionError(f"{self}: no session open")

    async def _open_session(self, context_id: str):
        self._session_context_id = context_id
        self._input_done = False
        self._session_answered = False
        self._session_playout = []
        self._session_stream_s = 0.0
        await self._connect()

    async def _end_session(self):
        """End the open session: its text ends, its audio arrives, the service closes it."""
        if self._receive_task:
            await self._end_input()
            await asyncio.wait([self._receive_task])
            self._receive_task = None
        await self._disconnect_websocket()
        self._session_context_id = None

    async def stop(self, frame: EndFrame):
        # A graceful end lets the open session end as it would: its text is done and its
        # audio arrives, or a cancel it was sent is answered.
        await self._end_session()
        await super().stop(frame)

    async def _connect(self):
        await super()._connect()
        await self._connect_websocket()
        if self._websocket and not self._receive_task:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self):
        await super()._disconnect()
        if self._receive_task:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()  # closing the socket cancels an unfinished session
        self._session_context_id = None

    async def _connect_websocket(self):
        """Open a socket and its session: ``session.start`` until ``session.started``."""
        websocket = None
        try:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            websocket = await self._websocket_connect(self._url, additional_headers=headers,
                                                      max_size=None)
            await websocket.send(json.dumps({
                "type": "session.start", "voice": self._settings.voice,
                "response_format": "pcm", "sample_rate": self.sample_rate,
                "timestamp_granularities": ["word"]}))
            reply = json.loads(await asyncio.wait_for(websocket.recv(), SESSION_START_TIMEOUT_S))
            if reply.get("type") != "session.started":
                raise ConnectionError(f"session refused: {reply.get('error', reply)}")
            self._websocket = websocket
            await self._call_event_handler("on_connected")
        except Exception as e:
            if websocket is not None:
                await websocket.close()
            self._websocket = None
            await self.push_error(error_msg=f"{self}: no session: {e}", exception=e)
            await self._call_event_handler("on_connection_error", f"{e}")

    async def _disconnect_websocket(self):
        websocket, self._websocket = self._websocket, None
        if websocket is None:
            return
        try:
            await self.stop_all_metrics()
            await websocket.close()
        finally:
            await self._call_event_handler("on_disconnected")

    # ---- audio out -------------------------------------------------------------------------

    async def _receive_messages(self):
        """The session's events and audio until the service closes it (a normal close raises
        ``ConnectionClosedOK``, which ends the receive task)."""
        websocket = self._get_websocket()
        context_id = self._session_context_id
        chunk: dict | None = None  # the audio.chunk event whose bytes come next
        try:
            while True:
                message = await websocket.recv()
                if isinstance(message, bytes):
                    await self._play_chunk(context_id, message, (chunk or {}).get("words"))
                    chunk = None
                    continue
                event = json.loads(message)
                kind = event.get("type")
                if kind == "audio.chunk":
                    chunk = event
                elif kind == "response.done":
                    self._session_answered = True
                    await self._end_audio(context_id)
                elif kind == "response.cancelled":
                    self._session_answered = True
                    await self._call_event_handler("on_speech_cancelled", event.get("played_s"),
                                                   event.get("spoken_text"))
                elif kind == "error":
                    error = event.get("error") or {}
                    await self.push_error(error_msg=f"{self}: {error.get('message', event)}")
        finally:
            # Closed without its answer (an error, the service's idle limit): the turn's audio
            # ends now, not stop_frame_timeout_s later.
            if not self._session_answered and not self._disconnecting:
                await self._end_audio(context_id)

    async def _play_chunk(self, context_id: str, audio: bytes, words: list[dict] | None):
        """A chunk's audio, and its words (those whose audio starts in it) timed where the
        listener hears them: their time in the stream, moved by any wait before the chunk, so a
        word reaches the context only once heard."""
        stream_offset_s = self._session_stream_s
        duration_s = len(audio) / (2 * self.sample_rate)
        heard_at_s = self._place_chunk(context_id, duration_s)
        self._session_stream_s += duration_s
        await self.append_to_audio_context(
            context_id, TTSAudioRawFrame(audio=audio, sample_rate=self.sample_rate,
                                         num_channels=1, context_id=context_id))
        if words:
            await self.add_word_timestamps(
                [(word["word"], heard_at_s + word["start"] - stream_offset_s) for word in words],
                context_id)

    async def _end_audio(self, context_id: str):
        if self.audio_context_available(context_id):
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)


class PcmFileOutputTransport(BaseOutputTransport):
    """A speaker that plays into a raw PCM file (s16le): each chunk takes its own duration to
    write, as on a sound card, so an interruption cuts the file where a listener stopped
    hearing, and the transport's clock releases each word as its audio is written."""

    def __init__(self, path: str | Path, params: TransportParams | None = None, **kwargs):
        # No silence after the end: a file has no device buffer to push the last words out.
        super().__init__(params or TransportParams(audio_out_enabled=True,
                                                   audio_out_end_silence_secs=0), **kwargs)
        self._path = Path(path)
        self._file = None
        self._played_bytes = 0
        self._playing_until = 0.0  # time.monotonic() when the chunk written last ends
        self._progress = asyncio.Condition()

    @property
    def played_s(self) -> float:
        """Seconds of audio played so far."""
        rate = self.sample_rate * self._params.audio_out_channels
        return self._played_bytes / (2 * rate) if rate else 0.0

    async def wait_played(self, seconds: float):
        """Return once ``seconds`` of audio have played."""
        async with self._progress:
            await self._progress.wait_for(lambda: self.played_s >= seconds)

    async def start(self, frame: StartFrame):
        await super().start(frame)
        self._file = self._path.open("wb")
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        now = time.monotonic()
        self._playing_until = max(self._playing_until, now) + (
            frame.num_frames / frame.sample_rate)
        self._file.write(frame.audio)
        await asyncio.sleep(self._playing_until - now)
        self._played_bytes += len(frame.audio)
        async with self._progress:
            self._progress.notify_all()
        return True

    async def cleanup(self):
        await super().cleanup()
        if self._file is not None:
            self._file.close()
            self._file = None


async def play_answer(args: argparse.Namespace) -> None:
    """An LLM's answer (the file's words at ``--words-per-s``) through the service to the
    speaker; with ``--barge-in-s`` the user cuts in once that much has played."""
    words = Path(args.text_file).read_text(encoding="utf-8").split()
    tts = SpeechStreamTTSService(url=args.url, api_key=args.api_key, voice=args.voice)
    speaker = PcmFileOutputTransport(args.out)
    assistant = LLMContextAggregatorPair(LLMContext()).assistant()
    worker = PipelineWorker(Pipeline([tts, speaker, assistant]),
                            params=PipelineParams(audio_out_sample_rate=args.sample_rate),
                            cancel_on_idle_timeout=False)
    started, turn_over = asyncio.Event(), asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _on_started(worker, frame):
        started.set()

    @tts.event_handler("on_speech_cancelled")
    async def _on_cancelled(service, played_s, spoken_text):
        print(f"cut in after {played_s} s; the service heard: {spoken_text!r}")

    @assistant.event_handler("on_assistant_turn_stopped")
    async def _on_turn_stopped(aggregator, message):
        state = "interrupted" if message.interrupted else "complete"
        print(f"the bot's turn ({state}) as the context keeps it: {message.content!r}")
        turn_over.set()

    async def type_answer():
        await worker.queue_frame(LLMFullResponseStartFrame())
        for index, word in enumerate(words):
            await worker.queue_frame(LLMTextFrame(word if index == 0 else " " + word))
            await asyncio.sleep(1.0 / args.words_per_s)
        await worker.queue_frame(LLMFullResponseEndFrame())

    async def converse():
        await started.wait()
        typing = asyncio.create_task(type_answer())
        if args.barge_in_s is not None:
            cut_in = asyncio.create_task(speaker.wait_played(args.barge_in_s))
            over = asyncio.create_task(turn_over.wait())
            await asyncio.wait([cut_in, over], return_when=asyncio.FIRST_COMPLETED)
            if cut_in.done() and not turn_over.is_set():
                typing.cancel()  # the LLM's answer stops with the interruption
                await worker.queue_frame(InterruptionFrame())
            cut_in.cancel()
            over.cancel()
        await asyncio.gather(typing, return_exceptions=True)
        await turn_over.wait()
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), converse())
    print(f"played {speaker.played_s:.2f} s of audio into {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://localhost:8000/v1/audio/speech/stream")
    parser.add_argument("--text-file", required=True)
    parser.add_argument("--words-per-s", type=float, default=8.0,
                        help="the LLM's pace (an LLM streams about 5-15 words per second)")
    parser.add_argument("--voice", default="alloy")
    parser.add_argument("--sample-rate", type=int, default=24000)
    parser.add_argument("--api-key")
    parser.add_argument("--out", default="pipecat.pcm", help="raw PCM, s16le mono")
    parser.add_argument("--barge-in-s", type=float,
                        help="cut in once this much audio has played")
    parser.add_argument("--log-level", default="WARNING", help="Pipecat's (loguru) log level")
    args = parser.parse_args()
    logger.remove()
    logger.add(sys.stderr, level=args.log_level)
    asyncio.run(play_answer(args))


if __name__ == "__main__":
    main()
