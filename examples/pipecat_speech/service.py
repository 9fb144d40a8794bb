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
arrives, one chunk after another (:class:`ListenerTimeline`).

``text_aggregation_mode=TextAggregationMode.TOKEN`` sends each token as it comes (the service
cuts streamed text at clause ends itself), so the first audio comes sooner; but Pipecat 1.14
holds a sentence's timed words until the sentence is complete, so a turn interrupted while the
LLM is still writing a sentence loses that sentence's heard words from the context.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
)
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode

from . import protocol
from .session import StreamSessionService
from .timeline import ListenerTimeline


class SpeechStreamTTSService(StreamSessionService):
    """Pipecat TTS over ``WS /v1/audio/speech/stream``, with word timestamps.

    One session per audio context (a bot turn, or a ``TTSSpeakFrame``), opened when its first
    text arrives and ended with ``input_text.done`` when the turn ends. The frames after a turn
    wait until its audio has arrived (``pause_frame_processing``), so sessions run one at a time
    (:class:`~.session.StreamSessionService`).

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
            url=url,
            api_key=api_key,
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
        self._timeline = ListenerTimeline()  # when the listener hears the audio
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
            for message in protocol.text_deltas(text):
                await self._get_websocket().send(message)
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

    # ---- interruptions, on the listener's timeline -----------------------------------------

    async def _handle_interruption(self, frame: InterruptionFrame, direction: FrameDirection):
        played_s = self._timeline.played_s(self.get_clock().get_time())
        await super()._handle_interruption(frame, direction)
        self._timeline.interrupted()
        # The session's context was dropped (or had gone quiet and closed): stop the session,
        # saying how much of it was heard.
        if (self._session_context_id is not None
                and self._session_context_id not in self.get_audio_contexts()):
            await self._cancel_session(played_s)

    async def _open_session(self, context_id: str):
        self._timeline.new_session()
        await super()._open_session(context_id)

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
        duration_s = len(audio) / (2 * self.sample_rate)
        heard_at_s, stream_offset_s = self._timeline.place_chunk(
            self.get_clock().get_time(), context_id, duration_s,
            self.audio_context_available(context_id))
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
