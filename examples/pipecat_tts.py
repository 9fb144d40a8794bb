"""A Pipecat TTS service that speaks through ``WS /v1/audio/speech/stream``.

The service, :class:`SpeechStreamTTSService`, and the speaker, :class:`PcmFileOutputTransport`,
are in ``examples/pipecat_speech/`` (its ``service.py`` says how the service times a turn's
words and cuts it short); this script runs them.

It plays an LLM's answer (the words of a text file, typed at an LLM's pace) through a pipeline
of the service, :class:`PcmFileOutputTransport` (a speaker that plays into a raw PCM file, s16le
mono, in real time) and an assistant context aggregator, then prints the bot's turn as the
context keeps it. ``--barge-in-s S`` cuts in once S seconds have played, as a user would, and
also prints what the service says was heard.

    python examples/pipecat_tts.py --url ws://localhost:8000/v1/audio/speech/stream \\
        --text-file speech.txt --out pipecat.pcm [--api-key KEY] [--barge-in-s 1.5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from loguru import logger
from pipecat.frames.frames import (
    EndFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.workers.runner import WorkerRunner
from pipecat_speech import PcmFileOutputTransport, SpeechStreamTTSService


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
