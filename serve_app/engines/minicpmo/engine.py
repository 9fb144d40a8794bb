"""Continuous-batching MiniCPM-o 2.6 speech engine (no Ray import): the public face.

The work is split by job: :mod:`.planning` (requests validated and tokenized into plans, in the
caller's thread), :mod:`.cloning` (voice cloning's calls), :mod:`.scheduler` (queue, slots,
aborts), :mod:`.device.runner` (device steps, CUDA graphs or eager), :mod:`.step_loop` (the step
thread: plan -> launch -> collect), :mod:`.output` (joining audio, chunks and usage to callers).
How the model makes speech: docs/minicpmo.md.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import sys
import threading
import time
from typing import AsyncIterator, Sequence

import numpy as np
import torch

from ..base import (AudioChunk, EngineStats, OutputSink, SpeechRequest, SubmitsIterators,
                    refuse_unsupported)
from ..streamed_text import StreamedText
from ..text_rule import MAX_TEXT_CHARS
from ..work_admission import StreamWork, WorkAdmission
from .benchmark_mode import BenchmarkMode
from .chat import ChatText
from .cloning import VoiceCloner
from .device.placement import DECODE_DTYPES, resolved_device, resolved_dtype
from .device.graph_runner import create_runner
from .model.codec import SAMPLE_RATE_HZ
from .model.loader import LoadedModel, load_speech_model
from .model.quantization import resolve_mode
from .options import EngineOptions, clones_voices
from .planning import RequestPlanner
from .scheduler import Scheduler, Stream, StreamPlan
from .speech_schedule import SpeechSchedule
from .step.record import StepRecord
from .step_loop import StepLoop
from .text import GENERATION_PROMPT
from .voices import DEFAULT_VOICE, VoiceTable, VoiceTurn
from .word_times import ReleasedWords

__all__ = ["EngineOptions", "MiniCPMOEngine", "StreamPlan"]

logger = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.001  # a GPU engine's process: see settle_gpu_process


def cap_gpu_memory(device: torch.device, gigabytes: float) -> None:
    """Cap this process's CUDA allocations on ``device`` at ``gigabytes`` (1e9 bytes): torch's
    caching allocator then refuses to grow past it, as a GPU of that size would."""
    if device.type != "cuda":
        logger.info("gpu_memory_gb applies to CUDA devices only; %s is uncapped", device)
        return
    # torch wants an index here: plain "cuda" (device: auto) is the current device.
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gigabytes * 1e9 / total), index)
    logger.info("CUDA allocations capped at %.1f GB of %.1f GB", gigabytes, total / 1e9)


def load_model(options: EngineOptions) -> LoadedModel:
    """The checkpoint ``options`` name on its device (random weights in a benchmark that asks for
    them), after capping the GPU memory if ``gpu_memory_gb`` is set."""
    started = time.perf_counter()
    benchmark = BenchmarkMode(**options.benchmark) if options.benchmark else None
    device = resolved_device(options)
    if options.gpu_memory_gb is not None:
        cap_gpu_memory(device, options.gpu_memory_gb)
    if benchmark is not None and benchmark.random_weights:
        model = benchmark.random_model(device, resolved_dtype(options),
                                       clip_encoder=options.voices,
                                       quantization=resolve_mode(options.quantization, device))
    else:
        model = load_speech_model(options.model, options.revision, device,
                                  resolved_dtype(options), quantization=options.quantization,
                                  audio_encoder=None if options.voices else False)
    logger.info("loaded %s in %.1f s", options.model, time.perf_counter() - started)
    return model


def settle_gpu_process() -> None:
    """Settings for the process of an engine on a GPU, once its model and graphs are built."""
    # The model, its graphs and the imports are millions of objects that live as long as the
    # process: out of the collector's sight, a full collection during a step scans only what the
    # streams made (as vLLM does after start; one engine per process).
    gc.collect()
    gc.freeze()
    # The step thread gives up the GIL at every device sync; a busy event-loop thread (delivering
    # hundreds of chunks a step) then keeps it until the switch interval ends, 5 ms by default,
    # several times a step. 1 ms bounds each such wait.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


class MiniCPMOEngine(SubmitsIterators):
    """The production engine: native batched MiniCPM-o 2.6 speech."""

    sample_rate_hz = SAMPLE_RATE_HZ
    modes = ("read", "chat")
    follows_instructions = True  # they become the system prompt, shaping the speaker embedding
    times_words = True  # when each word's text reaches the TTS (word_times.py: how rough)

    def __init__(self, model: LoadedModel, options: EngineOptions) -> None:
        room = model.config.tts.condition_length + options.chunk_frames
        if options.tts_max_positions < room:  # else any long text fails a whole step later
            raise ValueError(
                f"tts_max_positions ({options.tts_max_positions}) must hold the TTS text "
                f"condition ({model.config.tts.condition_length} positions) and one generate "
                f"call ({options.chunk_frames} frames): at least {room}")
        self.options = options
        self.model = model
        tok = model.tokenizer
        self._spk_id = tok.convert_tokens_to_ids("<|spk|>")
        self._gen_prompt_ids = tok(GENERATION_PROMPT, add_special_tokens=False)["input_ids"]
        chat = ChatText(tok, self._gen_prompt_ids, options.llm_max_positions)
        self._terminators = chat.terminators
        work = WorkAdmission(options.admission, options.admission_margin,
                             options.first_audio_deadline_s, options.max_slots,
                             options.max_chat_slots, options.behind_hold_s,
                             options.max_queue_wait_s or math.inf,
                             options.thin_listeners_hold_queue)
        self._scheduler = Scheduler(options.max_slots, options.max_chat_slots, options.max_queued,
                                    options.admission_interval_steps, work,
                                    options.prefill_prompts)
        model.decoder.to(DECODE_DTYPES[options.decode_dtype])  # before the runner captures it
        self._runner = create_runner(model, options, chat.penalty_width)
        if self._runner.device.type == "cuda":
            settle_gpu_process()
        # Voice cloning needs the audio encoder (loaded when ``options.voices`` is on).
        cloning = clones_voices(model, options)
        if options.voices and not cloning:
            logger.warning("voices are on but the model has no audio encoder: voice cloning is off")
        self._voices = VoiceTable(options.max_voices)
        self._cloner = VoiceCloner(model, self._runner, self._voices, cloning)
        self._planner = RequestPlanner(tok, self._gen_prompt_ids, self._voices,
                                       options.llm_max_positions, self.modes)
        self._loop = StepLoop(model, options, self._scheduler, self._runner, chat, self._spk_id,
                              self._gen_prompt_ids, self._voices)
        self._benchmark = BenchmarkMode.from_options(options.benchmark)

    @classmethod
    def from_options(cls, **raw: object) -> "MiniCPMOEngine":
        options = EngineOptions.from_raw(raw)
        return cls(load_model(options), options)

    @property
    def model_id(self) -> str:
        return self.options.served_model_name

    @property
    def clones_voices(self) -> bool:
        """Whether ``embed_voice``/``add_voice`` work (else they raise InvalidRequestError)."""
        return self._cloner.enabled

    def voices(self) -> list[str]:
        """``"default"`` and the cloned voices loaded now."""
        return [DEFAULT_VOICE] + self._voices.names()

    # ---- cloned voices (docs/minicpmo.md, "Cloned voices"; the work is .cloning's) ----------

    def embed_voice(self, samples: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        """A reference clip -> its audio embeddings, float32 [T, LLM hidden] (``add_voice``'s
        input; T is one per 40 ms). Refuses with ``InvalidRequestError(param="audio_sample")``
        a clip that is not mono, empty, non-finite, silent, shorter than 1 s or longer than
        30 s, or at a sample rate outside 8-192 kHz. Blocking; safe from any thread."""
        return self._cloner.embed(samples, sample_rate_hz)

    def add_voice(self, voice_id: str, embeddings: np.ndarray) -> None:
        """Register ``voice_id`` (replacing one of that id; streams already in the old one finish
        in it): its voice turn's LLM keys and values are computed here, once. Drops the least
        recently used voices no stream holds when ``max_voices`` are loaded; raises
        :class:`EngineOverloadedError` if every loaded voice is held. Blocking; safe from any
        thread."""
        self._cloner.add(voice_id, embeddings)

    def remove_voice(self, voice_id: str) -> None:
        """Forget ``voice_id`` (a no-op if it is not loaded); its running streams finish in it."""
        self._cloner.remove(voice_id)

    def voice_turn(self, audio_tokens: int) -> VoiceTurn:
        """The voice turn's token ids for ``audio_tokens`` embeddings, and their positions."""
        return self._cloner.turn(audio_tokens)

    # ---- requests to plans (the work is .planning's) ----------------------------------------

    def count_tokens(self, text: str) -> int:
        """LLM tokens of ``text`` (usage's input tokens)."""
        return self._planner.count_tokens(text)

    def validate(self, request: SpeechRequest) -> None:
        """Refuse what this engine cannot serve. Streamed requests are read-mode only and may
        start with no text; their prompt holds only the text known at submission."""
        refuse_unsupported(self, request)
        self._planner.validate(request)

    def plan(self, request: SpeechRequest) -> StreamPlan:
        """The request tokenized (in the caller's thread, not the step thread) into its plan."""
        return self._planner.plan(request)

    @property
    def benchmark(self) -> dict | None:
        """The benchmark-only setting in force (None in production)."""
        return self._benchmark.describe() if self._benchmark is not None else None

    def submit_to(self, requests: list[SpeechRequest], sink: OutputSink) -> None:
        for request in requests:
            self.validate(request)
        # a look at the engine's room before the tokenization a refusal would waste
        self._scheduler.check_room(*(StreamWork.of_request(r, cloned=r.voice != DEFAULT_VOICE)
                                     for r in requests))
        if self._benchmark is not None:
            requests = [self._benchmark.fix_lengths(r) for r in requests]
        self.submit_plans_to([self.plan(r) for r in requests], sink)

    def submit_plans(self, plans: Sequence[StreamPlan]) -> list[AsyncIterator[AudioChunk]]:
        """Admit prepared plans (the golden tests feed upstream's exact prompt and pieces)."""
        return self.iterators([p.request.request_id for p in plans],
                              lambda sink: self.submit_plans_to(plans, sink))

    def submit_plans_to(self, plans: Sequence[StreamPlan], sink: OutputSink) -> None:
        """Admit prepared plans, their output going to ``sink``. Each stream holds its cloned
        voice from here to its end (the table cannot drop it)."""
        # every plan carries its prompt's ids, so the step thread never tokenizes
        plans = self._planner.with_prompt_ids(plans)
        voices = self._voices.acquire([plan.request.voice for plan in plans])
        try:
            for plan, voice in zip(plans, voices):
                if plan.is_chat and voice is not None:
                    self._planner.check_chat_room(voice.length + len(plan.prompt_ids))  # re-added
            streams = [Stream(plan, sink, time.perf_counter(),
                              fed_text=StreamedText(MAX_TEXT_CHARS, len(plan.request.text))
                              if plan.text_feed is not None else None, voice=voice,
                              words=ReleasedWords(SAMPLE_RATE_HZ)
                              if plan.request.word_times else None)
                       for plan, voice in zip(plans, voices)]
            self._scheduler.enqueue(streams)
        except BaseException:
            self._voices.release(voices)
            raise
        self._loop.wake()

    def feed_text(self, request_id: str, delta: str, done: bool = False) -> None:
        """Append text to a streamed request (see :meth:`Engine.feed_text`); the step thread
        cuts it into pieces."""
        self._scheduler.feed(request_id, delta, done)
        self._loop.wake()

    def abort(self, request_id: str) -> None:
        self._scheduler.request_abort(request_id)
        self._loop.wake()

    def stats(self) -> EngineStats:
        stats = self._scheduler.stats()
        stats.step_budget_s = self._loop.step_budget_s
        if self._runner.device.type == "cuda":
            stats.device_memory_peak_bytes = torch.cuda.max_memory_reserved(self._runner.device)
        return stats

    def trace(self, request_id: str) -> SpeechSchedule | None:
        """The finished schedule of a stream (only with ``keep_traces``)."""
        return self._loop.trace(request_id)

    def device_work(self) -> dict[str, int]:
        """What the device has been asked to do so far, by kind (``ModelRunner.work``)."""
        return dict(self._runner.work)

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent in each phase of the step so far (only with ``profile_phases``)."""
        return self._loop.phase_seconds() if self.options.profile_phases else {}

    def step_phase_seconds(self) -> dict[str, float]:
        """Host seconds spent in each phase of the step so far, profiled or not: the served
        engine's busy periods log them per step (``EngineWatch``), beside bench_engine's
        ``step_phase_ms``."""
        return self._loop.phase_seconds()

    def step_log(self, since_s: float = 0.0) -> list[StepRecord]:
        """The engine's recent steps (the last ``STEP_LOG_LENGTH``) that began at or after
        ``since_s`` (``time.perf_counter()``), oldest first."""
        return [record for record in self._loop.step_log.copy() if record.started_s >= since_s]

    def warmup(self) -> None:
        """Run one short read request through every stage."""

        async def run() -> None:
            request = SpeechRequest(request_id=f"warmup-{time.monotonic_ns()}", text="Warm up.",
                                    mode="read")
            (stream,) = self.submit([request])
            async for _ in stream:
                pass

        # A thread of its own: the caller (a Serve replica's __init__) may sit inside a running loop.
        errors: list[BaseException] = []

        def target() -> None:
            try:
                asyncio.run(run())
            except BaseException as error:  # re-raised in the caller's thread
                errors.append(error)

        thread = threading.Thread(target=target, name="minicpmo-warmup")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    def close(self) -> None:
        self._loop.close()
