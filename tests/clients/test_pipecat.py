"""Pipecat's OpenAI TTS service (``pipecat.services.openai.tts.OpenAITTSService``) as a client of
the CPU service, through ``POST /v1/audio/speech`` with ``base_url`` pointed at it.

Driven as Pipecat's own tests drive a processor: in a pipeline run by a ``PipelineWorker``
(``pipecat.tests.utils.run_test`` for a plain utterance), frames in, frames out. The service
asks for ``pcm`` (24 kHz s16le) with Pipecat's default model, ``gpt-4o-mini-tts``.
"""

from __future__ import annotations

import asyncio

import pytest
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InterruptionFrame,
    InterruptionWorkerFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.tests.utils import run_test
from pipecat.workers.runner import WorkerRunner

from tests.clients.served import (
    LONG_TEXT,
    OPENAI_PCM_RATE_HZ,
    SENTENCE,
    assert_cut_short_by_the_client,
    assert_sounds_like_the_service,
    engine_stats,
)
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

# The pipeline must start (StartFrame through every processor) within this; generous for a
# loaded two-core machine (Pipecat's default is 1 s).
START_TIMEOUT_S = 60
# Pipecat ends an utterance's audio context (pushing its TTSStoppedFrame) once no audio came for
# this long, the first chunk's wait included: with its default (3 s) a first chunk later than
# that on a loaded machine came after a TTSStoppedFrame. The stop frame of a whole utterance
# comes this long after its last audio.
STOP_FRAME_TIMEOUT_S = 10


def pipecat_tts(server: Server, voice: str) -> OpenAITTSService:
    return OpenAITTSService(base_url=f"{server.base_url}/v1", api_key=server.api_key,
                            settings=OpenAITTSService.Settings(voice=voice),
                            stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S)


def audio_s(frames: list[Frame]) -> float:
    return sum(len(frame.audio) for frame in frames
               if isinstance(frame, TTSAudioRawFrame)) / 2 / OPENAI_PCM_RATE_HZ


@pytest.mark.parametrize("voice", ["marin", "cedar"])
def test_pipecat_speaks_a_sentence_in_24khz_frames_as_long_as_the_service_does(
        server: Server, voice: str) -> None:
    down, _ = asyncio.run(run_test(pipecat_tts(server, voice),
                                   frames_to_send=[TTSSpeakFrame(SENTENCE)],
                                   start_timeout=START_TIMEOUT_S))
    kinds = [type(frame) for frame in down]
    audio = [frame for frame in down if isinstance(frame, TTSAudioRawFrame)]
    assert audio, kinds
    assert {(frame.sample_rate, frame.num_channels) for frame in audio} == {
        (OPENAI_PCM_RATE_HZ, 1)}
    # One utterance: started, its audio, stopped.
    assert kinds.index(TTSStartedFrame) < kinds.index(TTSAudioRawFrame)
    assert kinds.index(TTSStoppedFrame) > len(kinds) - 1 - kinds[::-1].index(TTSAudioRawFrame)
    assert_sounds_like_the_service(server, audio_s(down), SENTENCE, voice)


class Listener(FrameProcessor):
    """The end of the pipeline, where a transport would play the audio: keeps every frame that
    reaches it and, as a user who starts talking over the bot does, asks the worker to
    interrupt once the first audio arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[Frame] = []
        self.interrupted = asyncio.Event()
        self._asked = False

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append(frame)
            if isinstance(frame, InterruptionFrame):
                self.interrupted.set()
            if isinstance(frame, TTSAudioRawFrame) and not self._asked:
                self._asked = True
                await self.push_frame(InterruptionWorkerFrame(), FrameDirection.UPSTREAM)
        await self.push_frame(frame, direction)


async def speak_until_interrupted(tts: OpenAITTSService, text: str) -> list[Frame]:
    """Speak ``text`` through ``tts`` to a :class:`Listener` that cuts in at the first audio;
    end the pipeline once the interruption has reached the listener. Every frame that
    reached the listener, in order."""
    listener = Listener()
    worker = PipelineWorker(Pipeline([tts, listener]), cancel_on_idle_timeout=False)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(_worker: PipelineWorker, _frame: Frame) -> None:
        started.set()

    async def drive() -> None:
        await asyncio.wait_for(started.wait(), START_TIMEOUT_S)
        await worker.queue_frame(TTSSpeakFrame(text))
        await listener.interrupted.wait()
        # Queued behind whatever the TTS service still had to say: had the interruption not
        # stopped it, the rest of the utterance would reach the listener before this ends.
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner()
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    return listener.frames


def test_pipecat_interruption_stops_the_audio_and_closes_the_http_stream(
        server: Server) -> None:
    before = engine_stats(server)
    frames = asyncio.run(speak_until_interrupted(pipecat_tts(server, "marin"), LONG_TEXT))
    kinds = [type(frame) for frame in frames]
    cut = kinds.index(InterruptionFrame)
    assert TTSAudioRawFrame in kinds[:cut]
    assert TTSAudioRawFrame not in kinds[cut:], kinds[cut:]
    # Seconds of a two-minute answer were heard, not the answer.
    assert audio_s(frames) < 30
    assert_cut_short_by_the_client(server, before)
