"""The service of examples/pipecat_tts.py (examples/pipecat_speech/) against the real app:
Pipecat pipelines that speak through ``WS /v1/audio/speech/stream``.

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
    BotStoppedSpeakingFrame,
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

from examples.pipecat_speech import PcmFileOutputTransport, SpeechStreamTTSService
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

# The pipeline must start (StartFrame through every processor) within this; generous for a
# loaded two-core machine (Pipecat's default is 1 s).
START_TIMEOUT_S = 60
# Waits for the pipeline fail the test after this instead of hanging it.
HANG_GUARD_S = 240
# An answer the LLM writes in two goes, with a pause between them (at the bar), and cut into
# 1.5 s into its second sentence.
SLOW_ANSWER = ("Let me check that for you. Then | the answer comes in a second sentence, long "
               "enough that the user cuts in while it is still being spoken aloud. And more.")
PAUSE_S = 2.0
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


class Conversation(BaseObserver):
    """A pipeline of the service, the example's real-time speaker and Pipecat's assistant
    context aggregator, run by a ``PipelineWorker``: what the service timed (every word it
    pushed towards the speaker, heard or not), the bot's turns as the context keeps them, and
    the service's answers to cancels."""

    def __init__(self, server: Server, speaker_path, **service_options) -> None:
        super().__init__()
        self.tts = SpeechStreamTTSService(url=socket_url(server), api_key=server.api_key,
                                          **service_options)
        self.speaker = PcmFileOutputTransport(speaker_path)
        self.assistant = LLMContextAggregatorPair(LLMContext()).assistant()
        self.worker = PipelineWorker(Pipeline([self.tts, self.speaker, self.assistant]),
                                     params=PipelineParams(audio_out_sample_rate=24000),
                                     observers=[self], cancel_on_idle_timeout=False)
        self.timed: list[TTSTextFrame] = []
        self.turns, self.cancels = [], []
        self.started, self.turn_stopped = asyncio.Event(), asyncio.Event()
        self.bot_stopped_speaking = asyncio.Event()

        @self.worker.event_handler("on_pipeline_started")
        async def _on_started(worker, frame):
            self.started.set()

        @self.tts.event_handler("on_speech_cancelled")
        async def _on_cancelled(service, played_s, spoken_text):
            self.cancels.append((played_s, spoken_text))

        @self.assistant.event_handler("on_assistant_turn_stopped")
        async def _on_turn_stopped(aggregator, message):
            self.turns.append(message)
            self.turn_stopped.set()

    async def on_push_frame(self, data: FramePushed) -> None:
        if data.source is self.tts and isinstance(data.frame, TTSTextFrame):
            self.timed.append(data.frame)
        elif data.source is self.speaker and isinstance(data.frame, BotStoppedSpeakingFrame):
            self.bot_stopped_speaking.set()

    async def write(self, text: str, first: bool = False) -> None:
        """The LLM writes ``text`` (word by word; ``first``: its answer starts with it)."""
        tokens = text.split(" ")
        await self.worker.queue_frames([LLMFullResponseStartFrame()] * first + [
            LLMTextFrame(token if first and index == 0 else " " + token)
            for index, token in enumerate(tokens)])

    async def interrupt(self) -> None:
        """The user cuts in; once the turn is kept, the pipeline ends."""
        await self.worker.queue_frame(InterruptionFrame())
        await self.turn_stopped.wait()
        await self.worker.queue_frame(EndFrame())

    async def run(self, converse) -> None:
        async def guarded() -> None:
            async with asyncio.timeout(HANG_GUARD_S):
                await self.started.wait()
                await converse()

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(self.worker)
        await asyncio.gather(runner.run(), guarded())

    def kept_and_heard(self, answer: str) -> tuple[list[str], list[str]]:
        """The words the interrupted turn kept (a nonempty, proper prefix of ``answer``) and
        those the service says were heard (a nonempty prefix of the kept ones: the turn may
        end with the word being spoken at the cut)."""
        [turn] = self.turns
        assert turn.interrupted
        kept, words = turn.content.split(), answer.split()
        assert kept == words[:len(kept)] and 0 < len(kept) < len(words), turn.content
        [(played_s, spoken_text)] = self.cancels  # the open session got the cancel
        heard = spoken_text.split()
        assert played_s > 0 and heard and heard == kept[:len(heard)], (played_s, heard, kept)
        return kept, heard


async def test_an_interrupted_turn_keeps_only_the_words_heard(server: Server, tmp_path) -> None:
    talk = Conversation(server, tmp_path / "heard.pcm")

    async def converse() -> None:
        await talk.write(ANSWER, first=True)  # three sentences, and the LLM writes the fourth
        # The user cuts in a second into the answer, inside its first clause (whose words all
        # came with its audio, in one chunk).
        await talk.speaker.wait_played(1.0)
        await talk.interrupt()

    await talk.run(converse)
    kept, _ = talk.kept_and_heard(ANSWER)
    # Synthesis ran ahead of playback: the service timed words the user never heard, and the
    # turn left them out.
    timed = [frame.text for frame in talk.timed]
    assert timed[:len(kept)] == kept and len(timed) > len(kept), timed


async def test_text_slower_than_speech_has_its_words_timed_after_the_wait(
        server: Server, tmp_path) -> None:
    talk = Conversation(server, tmp_path / "heard.pcm")
    first, rest = SLOW_ANSWER.split(" | ")

    async def converse() -> None:
        await talk.write(first, first=True)
        await talk.bot_stopped_speaking.wait()  # the first sentence has played
        await asyncio.sleep(PAUSE_S)  # the LLM pauses (a tool call); the listener waits
        played_s = talk.speaker.played_s
        await talk.write(rest)
        await talk.speaker.wait_played(played_s + 1.5)
        await talk.interrupt()

    await talk.run(converse)
    kept, heard = talk.kept_and_heard(SLOW_ANSWER.replace(" | ", " "))
    # The second sentence's words are timed where the listener hears them: after the pause (the
    # first sentence had played out before it), not where they lie in the session's audio,
    # right after the first sentence. Timed that early, the transport would have let the words
    # of PAUSE_S more of speech into the turn before anyone heard them.
    words = len(first.split()) - 1  # "Then" waits for the rest
    last, following = talk.timed[words - 1], talk.timed[words]
    assert (last.text, following.text) == ("you.", "Then")
    assert following.pts - last.pts > PAUSE_S * 1e9, (last.pts, following.pts)
    assert len(kept) - len(heard) <= 2, (kept, heard)  # at most the word cut, and one at the cut
