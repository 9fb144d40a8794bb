"""Continuous-batching MiniCPM-o 2.6 speech engine (no Ray import): the public face.

The work is split by job: :mod:`.scheduler` (queue, slots, aborts), :mod:`.runner` (device
steps, CUDA graphs or eager), :mod:`.step_loop` (the step thread: admit -> run -> emit),
:mod:`.output` (joining audio, chunks to callers). How the model makes speech:
docs/minicpmo.md.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from dataclasses import replace
from typing import AsyncIterator, Sequence

import numpy as np
import torch

from ..text_rule import MAX_TEXT_CHARS, check_text
from ..base import (
    TEXT_INPUTS,
    AudioChunk,
    EngineStats,
    InvalidRequestError,
    OutputSink,
    SpeechRequest,
    SubmitsIterators,
)
from ..streamed_text import StreamedText
from .benchmark_mode import BenchmarkMode
from .chat import ChatText
from .device.placement import DECODE_DTYPES, resolved_device, resolved_dtype
from .device.runner import create_runner
from .model.audio_in import prepare_clip
from .model.codec import SAMPLE_RATE_HZ, SAMPLES_PER_CODE_FRAME
from .model.loader import LoadedModel, load_speech_model
from .model.quantization import resolve_mode
from .options import EngineOptions, clones_voices
from .scheduler import Scheduler, Stream, StreamPlan
from .speech_schedule import SpeechSchedule
from .step_loop import StepLoop, StepRecord
from .usage import CountedPlan
from .text import (
    GENERATION_PROMPT,
    PIECE_TOKENS,
    READ_INSTRUCTION,
    TextFeed,
    cut_into_pieces,
    has_speakable_text,
    user_turn,
)
from .voices import DEFAULT_VOICE, VoiceTable, VoiceTurn, check_voice_id, voice_turn

__all__ = ["EngineOptions", "MiniCPMOEngine", "StreamPlan"]

logger = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.001  # a GPU engine's process: see MiniCPMOEngine.__init__


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


class MiniCPMOEngine(SubmitsIterators):
    """The production engine: native batched MiniCPM-o 2.6 speech."""

    sample_rate_hz = SAMPLE_RATE_HZ
    modes = ("read", "chat")
    samples_per_audio_token = SAMPLES_PER_CODE_FRAME  # one audio code frame per output token
    follows_instructions = True  # they become the system prompt, shaping the speaker embedding

    def __init__(self, model: LoadedModel, options: EngineOptions) -> None:
        self.options = options
        self.model = model
        tok = model.tokenizer
        self._spk_id = tok.convert_tokens_to_ids("<|spk|>")
        self._gen_prompt_ids = tok(GENERATION_PROMPT, add_special_tokens=False)["input_ids"]
        chat = ChatText(tok, self._gen_prompt_ids, options.llm_max_positions)
        self._terminators = chat.terminators
        self._scheduler = Scheduler(options.max_slots, options.max_chat_slots, options.max_queued,
                                    options.admission_interval_steps)
        model.decoder.to(DECODE_DTYPES[options.decode_dtype])  # before the runner captures it
        self._runner = create_runner(model, options, chat.penalty_width)
        if self._runner.device.type == "cuda":
            # The model, its graphs and the imports are millions of objects that live as long as
            # the process: out of the collector's sight, a full collection during a step scans
            # only what the streams made (as vLLM does after start; one engine per process).
            gc.collect()
            gc.freeze()
            # The step thread gives up the GIL at every device sync; a busy event-loop thread
            # (delivering hundreds of chunks a step) then keeps it until the switch interval
            # ends, 5 ms by default, several times a step. 1 ms bounds each such wait.
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # Voice cloning needs the audio encoder (loaded when ``options.voices`` is on).
        self.clones_voices = clones_voices(model, options)
        if options.voices and not self.clones_voices:
            logger.warning("voices are on but the model has no audio encoder: voice cloning is off")
        self._voices = VoiceTable(options.max_voices)
        # One clip or voice turn is computed at a time (in the caller's thread, beside the step
        # thread, on models the step thread only reads and caches of its own).
        self._voice_work = threading.Lock()
        self._loop = StepLoop(model, options, self._scheduler, self._runner, chat, self._spk_id,
                              self._gen_prompt_ids, self._voices)
        self._benchmark = BenchmarkMode.from_options(options.benchmark)

    @classmethod
    def from_options(cls, **raw: object) -> "MiniCPMOEngine":
        options = EngineOptions.from_raw(raw)
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
        return cls(model, options)

    @property
    def model_id(self) -> str:
        return self.options.served_model_name

    def voices(self) -> list[str]:
        """``"default"`` and the cloned voices loaded now."""
        return [DEFAULT_VOICE] + self._voices.names()

    # ---- cloned voices (docs/minicpmo.md, "Cloned voices") ----------------------------------

    def embed_voice(self, samples: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        """A reference clip -> its audio embeddings, float32 [T, LLM hidden] (``add_voice``'s
        input; T is one per 40 ms). Refuses with ``InvalidRequestError(param="audio_sample")``
        a clip that is not mono, empty, non-finite, silent, shorter than 1 s or longer than
        30 s, or at a sample rate outside 8-192 kHz. Blocking; safe from any thread."""
        self._refuse_without_voices()
        clip = prepare_clip(samples, sample_rate_hz)
        with self._voice_work, torch.inference_mode():
            embeddings = self.model.clip_encoder.embed(clip)
            return embeddings.float().cpu().numpy()

    def add_voice(self, voice_id: str, embeddings: np.ndarray) -> None:
        """Register ``voice_id`` (replacing one of that id; streams already in the old one finish
        in it): its voice turn's LLM keys and values are computed here, once. Drops the least
        recently used voices no stream holds when ``max_voices`` are loaded; raises
        :class:`EngineOverloadedError` if every loaded voice is held. Blocking; safe from any
        thread."""
        self._refuse_without_voices()
        check_voice_id(voice_id)
        audio = self._check_embeddings(embeddings)
        self._voices.check_room(voice_id)
        turn = self.voice_turn(len(audio))
        with self._voice_work, torch.inference_mode():
            voice = self._runner.voice_prefix(voice_id, turn, torch.from_numpy(audio))
        dropped = self._voices.add(voice)
        logger.info("voice %s added (%d prompt tokens, %.1f MB of keys and values)%s", voice_id,
                    voice.length, voice.nbytes / 1e6,
                    f"; dropped {', '.join(dropped)}" if dropped else "")

    def remove_voice(self, voice_id: str) -> None:
        """Forget ``voice_id`` (a no-op if it is not loaded); its running streams finish in it."""
        self._refuse_without_voices()
        self._voices.remove(check_voice_id(voice_id))

    def voice_turn(self, audio_tokens: int) -> VoiceTurn:
        """The voice turn's token ids for ``audio_tokens`` embeddings, and their positions."""
        tok = self.model.tokenizer
        return voice_turn(lambda text: tok(text, add_special_tokens=False)["input_ids"],
                          tok.convert_tokens_to_ids, audio_tokens,
                          self.model.config.audio.tokens_per_chunk)

    def _check_embeddings(self, embeddings: np.ndarray) -> np.ndarray:
        width, most = self.model.config.llm.hidden_size, self.model.config.audio.max_audio_tokens
        array = np.asarray(embeddings) if isinstance(embeddings, np.ndarray) else None
        if (array is None or array.ndim != 2 or array.dtype.kind != "f" or array.shape[1] != width
                or not 1 <= array.shape[0] <= most):
            raise InvalidRequestError(
                f"voice embeddings must be a float array [T, {width}] with 1 <= T <= {most} "
                "(what embed_voice returns)", "embeddings", code="invalid_embeddings")
        if not np.isfinite(array).all():
            raise InvalidRequestError("voice embeddings hold NaN or infinite values",
                                      "embeddings", code="invalid_embeddings")
        return np.ascontiguousarray(array, dtype=np.float32)

    def _refuse_without_voices(self) -> None:
        if not self.clones_voices:
            raise InvalidRequestError(
                "voice cloning is off in this engine (engine_options.voices is false, or the "
                "model has no audio encoder)", "voice", code="voice_cloning_off")

    def count_tokens(self, text: str) -> int:
        """LLM tokens of ``text`` (usage's input tokens)."""
        return len(self.model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def validate(self, request: SpeechRequest) -> None:
        """Refuse what this engine cannot serve. Streamed requests are read-mode only and may
        start with no text; their prompt holds only the text known at submission."""
        text = request.text
        streamed = request.text_input == "streamed"
        if request.text_input not in TEXT_INPUTS:
            raise InvalidRequestError(f"unknown text_input {request.text_input!r}", "text_input")
        if streamed and request.mode != "read":
            raise InvalidRequestError("streamed text input needs mode 'read'", "text_input",
                                      code="unsupported_text_input")
        if not streamed:
            check_text(text)  # the shared rule (serve_app.engines.text_rule)
        elif len(text) > MAX_TEXT_CHARS:
            raise InvalidRequestError(f"text is longer than {MAX_TEXT_CHARS} characters", "text",
                                      code="text_too_long")
        if request.mode not in self.modes:
            raise InvalidRequestError(f"unknown mode {request.mode!r}", "mode")
        if request.mode == "read" and not streamed and not has_speakable_text(text):
            raise InvalidRequestError("text holds nothing speakable (no letters or digits)", "text",
                                      code="nothing_to_speak")
        if request.voice != DEFAULT_VOICE:
            self._voices.prefix_length(request.voice)  # raises voice_not_found
        if request.speed != 1.0:
            raise InvalidRequestError("this engine speaks at speed 1.0 only", "speed")
        request.sampling.validate()
        if request.mode == "chat":
            prompt_tokens = len(self.model.tokenizer(self._prompt_text(request),
                                                      add_special_tokens=False)["input_ids"])
            voice_tokens = (self._voices.prefix_length(request.voice)
                            if request.voice != DEFAULT_VOICE else 0)
            self._check_chat_room(voice_tokens + prompt_tokens)

    def _check_chat_room(self, prompt_tokens: int) -> None:
        """A chat answer needs room in the LLM cache after its prompt (voice turn included)."""
        budget = self.options.llm_max_positions - prompt_tokens - len(self._gen_prompt_ids)
        if budget < PIECE_TOKENS + 1:
            raise InvalidRequestError("text is too long for a chat turn", "text",
                                      code="text_too_long")

    def _prompt_text(self, request: SpeechRequest) -> str:
        if request.mode == "read":
            return user_turn(READ_INSTRUCTION + request.text, request.system_prompt)
        return user_turn(request.text, request.system_prompt)

    def plan(self, request: SpeechRequest) -> StreamPlan:
        prompt = self._prompt_text(request)
        tok = self.model.tokenizer
        # Tokenized here, in the caller's thread, not in the engine's step thread.
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        instructions = self.count_tokens(request.system_prompt or "")  # usage's input tokens
        if request.text_input == "streamed":
            feed = TextFeed(lambda text: tok(text, add_special_tokens=False)["input_ids"], tok.decode)
            return CountedPlan(request, prompt, feed.push(request.text), text_feed=feed,
                               prompt_ids=prompt_ids, input_tokens=instructions)
        if request.mode == "read":
            ids = tok(request.text, add_special_tokens=False)["input_ids"]
            return CountedPlan(request, prompt, cut_into_pieces(ids, tok.decode),
                               prompt_ids=prompt_ids, input_tokens=instructions + len(ids))
        return CountedPlan(request, prompt, None, prompt_ids=prompt_ids,
                           input_tokens=instructions + self.count_tokens(request.text))

    @property
    def benchmark(self) -> dict | None:
        """The benchmark-only setting in force (None in production)."""
        return self._benchmark.describe() if self._benchmark is not None else None

    def submit_to(self, requests: list[SpeechRequest], sink: OutputSink) -> None:
        for request in requests:
            self.validate(request)
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
        tok = self.model.tokenizer
        # every plan carries its prompt's ids, so the step thread never tokenizes
        plans = [plan if plan.prompt_ids is not None else
                 replace(plan, prompt_ids=tok(plan.prompt, add_special_tokens=False)["input_ids"])
                 for plan in plans]
        voices = self._voices.acquire([plan.request.voice for plan in plans])
        try:
            for plan, voice in zip(plans, voices):
                if plan.is_chat and voice is not None:
                    self._check_chat_room(voice.length + len(plan.prompt_ids))  # voice re-added
            streams = [Stream(plan, sink, time.perf_counter(),
                              fed_text=StreamedText(MAX_TEXT_CHARS, len(plan.request.text))
                              if plan.text_feed is not None else None, voice=voice)
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
        stats.step_budget_s = self.options.steps_per_sync * SAMPLES_PER_CODE_FRAME / SAMPLE_RATE_HZ
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
