"""examples/pipecat_tts.py against the real app: Pipecat pipelines that speak through
``WS /v1/audio/speech/stream``.

Driven as Pipecat's own tests drive a processor, in a pipeline run by a ``PipelineWorker``
(``pipecat.tests.utils.run_test`` for a plain utterance). The interrupted turn plays into the
example's ``PcmFileOutputTransport`` (Pipecat's ``BaseOutputTransport``, writing in real time
where a sound card would play), whose clock releases each word as its audio plays, and ends in
Pipecat's assistant context aggregator, which keeps the bot's turn.
"""

from __future__ import annotations

import asyncio

import pytest
from pipecat.frames.frames import (
    EndFrame,
    InterruptionFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.tests.utils import run_test
from pipecat.workers.runner import WorkerRunner

from examples.pipecat_tts import PcmFileOutputTransport, SpeechStreamTTSService
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

# The pipeline must start (StartFrame through every processor) within this; generous for a
# loaded two-core machine (Pipecat's default is 1 s).
START_TIMEOUT_S = 60
# Waits for the pipeline fail the test after this instead of hanging it.
HANG_GUARD_S = 240
SENTENCE = "The service speaks this sentence, and every word of it comes back with its time."
# Complete sentences, then one the LLM is still writing when the user cuts in.
ANSWER = ("A voice agent speaks this answer, sentence by sentence. The user cuts in before "
          "it ends, so only some of it is heard. The rest is never played, and the agent must "
          "not remember saying it. This last sentence is still being")


def socket_url(server: Server) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"


async def test_a_sentence_gives_audio_at_the_asked_rate_and_its_words_in_order(
        server: Server) -> None:
    tts = SpeechStreamTTSService(url=socket_url(server), api_key=server.api_key,
                                 sample_rate=16000)
    down, _ = await run_test(tts, frames_to_send=[TTSSpeakFrame(SENTENCE)],
                             start_timeout=START_TIMEOUT_S)
    audio = [frame for frame in down if isinstance(frame, TTSAudioRawFrame)]
    words = [frame for frame in down if isinstance(frame, TTSTextFrame)]
    assert audio and all(f.sample_rate == 16000 and f.num_channels == 1 for f in audio)
    assert sum(f.num_frames for f in audio) / 16000 > 2.0  # the whole sentence was spoken
    assert [w.text for w in words] == SENTENCE.split()  # one frame per word, in order
    times = [w.pts for w in words]
    assert all(earlier < later for earlier, later in zip(times, times[1:])), (
        "each word at its own time, after the one before")
    kinds = [type(frame) for frame in down if isinstance(frame, (TTSStartedFrame,
                                                                 TTSStoppedFrame))]
    assert kinds == [TTSStartedFrame, TTSStoppedFrame]


class WordsTimed(BaseObserver):
    """The words the TTS service has timed (pushed towards the transport), heard or not."""

    def __init__(self, tts: SpeechStreamTTSService) -> None:
        super().__init__()
        self.tts = tts
        self.words: list[str] = []

    async def on_push_frame(self, data: FramePushed) -> None:
        if data.source is self.tts and isinstance(data.frame, TTSTextFrame):
            self.words.append(data.frame.text)


async def test_an_interrupted_turn_keeps_only_the_words_heard(server: Server, tmp_path) -> None:
    tts = SpeechStreamTTSService(url=socket_url(server), api_key=server.api_key)
    speaker = PcmFileOutputTransport(tmp_path / "heard.pcm")
    assistant = LLMContextAggregatorPair(LLMContext()).assistant()
    timed = WordsTimed(tts)
    worker = PipelineWorker(Pipeline([tts, speaker, assistant]),
                            params=PipelineParams(audio_out_sample_rate=24000),
                            observers=[timed], cancel_on_idle_timeout=False)
    started, turn_stopped = asyncio.Event(), asyncio.Event()
    turns, cancels = [], []

    @worker.event_handler("on_pipeline_started")
    async def _on_started(worker, frame):
        started.set()

    @tts.event_handler("on_speech_cancelled")
    async def _on_cancelled(service, played_s, spoken_text):
        cancels.append((played_s, spoken_text))

    @assistant.event_handler("on_assistant_turn_stopped")
    async def _on_turn_stopped(aggregator, message):
        turns.append(message)
        turn_stopped.set()

    async def converse() -> None:
        async with asyncio.timeout(HANG_GUARD_S):
            await started.wait()
            # The LLM has written three sentences and is writing the fourth.
            tokens = ANSWER.split(" ")
            await worker.queue_frames([LLMFullResponseStartFrame()] + [
                LLMTextFrame(token if index == 0 else " " + token)
                for index, token in enumerate(tokens)])
            await speaker.wait_played(2.0)  # the user cuts in two seconds into the answer
            await worker.queue_frame(InterruptionFrame())
            await turn_stopped.wait()
            await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), converse())

    [turn] = turns
    assert turn.interrupted
    kept, answer = turn.content.split(), ANSWER.split()
    assert kept == answer[:len(kept)] and 0 < len(kept) < len(answer), turn.content
    # Synthesis ran ahead of playback: the service timed words the user never heard, and the
    # turn left them out.
    assert timed.words[:len(kept)] == kept and len(timed.words) > len(kept), timed.words
    # The session was still open (the fourth sentence unfinished): it got the cancel with the
    # seconds played, and the words it says were heard (each one finished) are in the turn,
    # which may end with the word being spoken at the cut.
    [(played_s, spoken_text)] = cancels
    heard = spoken_text.split()
    assert played_s > 0 and heard and heard == kept[:len(heard)], (played_s, spoken_text, kept)
