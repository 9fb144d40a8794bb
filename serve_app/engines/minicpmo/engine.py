"""Continuous-batching MiniCPM-o 2.6 speech engine (no Ray import).

One step loop, on its own thread, advances every admitted stream together:

1. admission: batched LLM prefill of new requests -> speaker embeddings (and, in chat mode,
   the first token); read-mode prefills use a throwaway cache, chat streams keep an LLM slot;
2. one batched LLM decode step for chat streams that still produce text (3 tokens per piece);
3. per stream, the pure :class:`~.schedule.SpeechSchedule` turns pieces into work;
4. batched TTS text prefills, then one batched audio step for every generating stream;
5. batched DVAE + Vocos decode of the streams that completed a generate call; audio that can
   no longer change is handed to the caller at once.

Requests are plain records that move from the admission queue into slots; ``abort`` frees a
slot at the start of the next step.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import numpy as np
import torch

from ..base import (
    AudioChunk,
    EngineError,
    EngineOverloadedError,
    EngineStats,
    InvalidRequestError,
    RequestAbortedError,
    SpeechRequest,
)
from ..faults import FaultInjection, crash_process
from .audio_step import (
    ACTIVE,
    BOS,
    CALL_FRAMES,
    COUNTER,
    EOS_AFTER,
    FRAME0,
    GREEDY,
    PACKED_COLUMNS,
    POSITION,
    PREFILL_TOKENS,
    SEED,
    STEPS_LEFT,
    TEXT_LEN,
    WARP,
    AudioStepGraphs,
    TextPrefillGraphs,
    attention_span,
    audio_visibility,
    audio_window,
    key_count_buckets,
    text_prefill_step,
)
from .codec import SAMPLES_PER_CODE_FRAME, StreamingAudioJoiner
from .decode_graphs import MultiLengthDecodeGraphs
from .layers import (
    ONE_QUERY_KERNELS,
    SlotKVCache,
    StepInputs,
    causal_attend,
    fuse_projections,
    set_one_query_attention,
)
from .llm_step import (
    LLMPrefillGraphs,
    LLMStepGraphs,
    LLMStepInputs,
    llm_decode_step,
    llm_prefill,
    sample_next_token,
)
from .loader import DEFAULT_MODEL_ID, LoadedModel, load_speech_model
from .quantization import check_mode as check_quantization
from .schedule import CarryPrefill, DecodeJob, Phase, SpeechSchedule, TextPrefill
from .text import (
    GENERATION_PROMPT,
    PIECE_TOKENS,
    READ_INSTRUCTION,
    TERMINATOR_TOKENS,
    TTS_EOS_MARK,
    PieceDecoder,
    cut_into_pieces,
    has_speakable_text,
    user_turn,
)

logger = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 24_000
SAMPLES_PER_FRAME = 512
MAX_TEXT_CHARS = 4096


@dataclass(frozen=True)
class EngineOptions:
    """Engine configuration (``engine_options`` in serve_config.yaml)."""

    model: str = DEFAULT_MODEL_ID
    revision: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_slots: int = 64
    max_chat_slots: int = 32
    max_queued: int = 256
    tts_max_positions: int = 1536
    llm_max_positions: int = 2048
    chunk_frames: int = 25
    tts_sampling: str = "sample"  # "greedy" makes codes independent of the batch
    max_segment_frames: int = 2048
    voices: tuple[str, ...] = ("default",)
    served_model_name: str = "MiniCPM-o-2_6"  # what /v1/models shows (never a local path)
    keep_traces: bool = False  # tests: keep each finished stream's codes (see ``trace``)
    cuda_graphs: bool = True  # replay the TTS audio step and the decode as CUDA graphs
    profile_phases: bool = False  # benchmarks: time each phase of the step (adds GPU syncs)
    llm_lookahead_pieces: int = 2  # chat: decode ahead of the TTS by at most this many pieces
    steps_per_sync: int = 5  # audio frames per engine step, chained on the device (one host sync);
    # a divisor of chunk_frames keeps every generate call aligned to engine steps
    one_query_attention: str = "sdpa"  # decode-step attention: sdpa | matmul (layers.py)
    fuse_projections: bool = True  # q/k/v and gate/up as one matmul each (unquantized layers)
    admission_interval_steps: int = 1  # while streams run, admit every N engine steps
    quantization: str = "none"  # LLM decoder linears: none | int8 | int4 (torchao, `quant` extra)
    fault_injection: dict | None = None  # tests only: fail/crash markers (see engines/faults.py)

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        if self.one_query_attention not in ONE_QUERY_KERNELS:
            raise ValueError(f"one_query_attention must be one of {ONE_QUERY_KERNELS}")
        if self.steps_per_sync < 1:
            raise ValueError("steps_per_sync must be at least 1")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return {"bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32}[self.dtype]


@dataclass
class StreamPlan:
    """What a stream speaks: a prompt for the speaker embedding and either fixed text pieces
    (read mode) or LLM decoding (chat mode)."""

    request: SpeechRequest
    prompt: str
    pieces: list[str] | None


@dataclass
class _Stream:
    plan: StreamPlan
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted_at: float
    schedule: SpeechSchedule | None = None
    slot: int = -1
    llm_slot: int = -1
    speaker: torch.Tensor | None = None
    pieces: collections.deque = field(default_factory=collections.deque)
    text_done: bool = False
    # chat-mode LLM state
    llm_len: int = 0
    next_token: int | None = None
    group: list[int] = field(default_factory=list)
    penalty_window: list[int] = field(default_factory=list)
    piece_decoder: PieceDecoder | None = None
    llm_tokens: int = 0
    tts_steps: int = 0
    llm_steps: int = 0
    joiner: StreamingAudioJoiner | None = None
    first_audio_at: float | None = None
    samples_out: int = 0
    chunks_sent: int = 0
    done: bool = False

    @property
    def request_id(self) -> str:
        return self.plan.request.request_id


class MiniCPMOEngine:
    """The production engine: native batched MiniCPM-o 2.6 speech."""

    sample_rate_hz = SAMPLE_RATE_HZ
    modes = ("read", "chat")
    samples_per_audio_token = SAMPLES_PER_CODE_FRAME  # one audio code frame per output token

    def __init__(self, model: LoadedModel, options: EngineOptions) -> None:
        self.options = options
        self.model = model
        self.device = next(model.tts.parameters()).device
        self.dtype = next(model.tts.parameters()).dtype
        cfg = model.config
        self.tts_cache = SlotKVCache(cfg.tts_shape(), options.max_slots, options.tts_max_positions,
                                     self.device, self.dtype)
        self.llm_cache = SlotKVCache(cfg.llm, options.max_chat_slots, options.llm_max_positions,
                                     self.device, self.dtype)
        tok = model.tokenizer
        self._terminators = [tok.convert_tokens_to_ids(t) for t in TERMINATOR_TOKENS]
        self._tts_eos_id = tok.convert_tokens_to_ids(TTS_EOS_MARK)
        self._spk_id = tok.convert_tokens_to_ids("<|spk|>")
        self._stts_id = model.tts_tokenizer.convert_tokens_to_ids("[Stts]")
        self._gen_prompt_ids = tok(GENERATION_PROMPT, add_special_tokens=False)["input_ids"]
        self._free_slots = list(range(options.max_slots))  # a heap: lowest slot first
        self._free_llm_slots = list(range(options.max_chat_slots))  # a heap: lowest slot first
        self._penalty_width = len(self._gen_prompt_ids) + PIECE_TOKENS + 1
        self._pending: collections.deque[_Stream] = collections.deque()
        self._active: dict[str, _Stream] = {}
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._stats = EngineStats(max_slots=options.max_slots)
        self._window = options.steps_per_sync
        if options.fuse_projections:
            fuse_projections(model.tts)
            fuse_projections(model.llm)
        set_one_query_attention(model.tts, options.one_query_attention)
        set_one_query_attention(model.llm, options.one_query_attention)
        self._spans = key_count_buckets(options.tts_max_positions + 1)
        self._traces: dict[str, SpeechSchedule] = {}
        self._step_counter = itertools.count()
        self._graphs = (AudioStepGraphs(model.tts, self.tts_cache, self.device, self._window)
                        if options.cuda_graphs and self.device.type == "cuda" else None)
        self._decoder = model.decoder
        self._prefill_graphs = (TextPrefillGraphs(model.tts, self.tts_cache, self.device)
                                if self._graphs is not None else None)
        self._llm_graphs = (LLMStepGraphs(model.llm, self.llm_cache, self._penalty_width, self.device)
                            if self._graphs is not None else None)
        self._llm_prefill_graphs = (LLMPrefillGraphs(model.llm, cfg.llm, self.device, self.dtype)
                                    if self._graphs is not None else None)
        if self._graphs is not None:
            self._graphs.capture_all()
            self._llm_prefill_graphs.capture_all()
            self._prefill_graphs.capture_all()
            self._llm_graphs.capture_all()
            decode_graphs = MultiLengthDecodeGraphs(
                model.decoder, (options.chunk_frames, options.chunk_frames + 4),
                min(options.max_slots, 64))
            try:
                decode_graphs.capture_all()
                self._decoder = decode_graphs
            except RuntimeError:
                logger.exception("decode could not be captured as a CUDA graph; decoding eagerly")
        self._phase_s: dict[str, float] = collections.defaultdict(float)
        self._faults = FaultInjection.from_options(options.fault_injection)
        self._thread = threading.Thread(target=self._run, name="minicpmo-engine", daemon=True)
        self._thread.start()

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_options(cls, **raw: object) -> "MiniCPMOEngine":
        fields = EngineOptions.__dataclass_fields__
        unknown = set(raw) - set(fields)
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}")
        if "voices" in raw:
            raw["voices"] = tuple(raw["voices"])  # type: ignore[arg-type]
        options = EngineOptions(**raw)  # type: ignore[arg-type]
        started = time.perf_counter()
        model = load_speech_model(options.model, options.revision, options.resolved_device(),
                                  options.resolved_dtype(), quantization=options.quantization)
        logger.info("loaded %s in %.1f s", options.model, time.perf_counter() - started)
        return cls(model, options)

    # ---- public API ------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.options.served_model_name

    def voices(self) -> list[str]:
        return list(self.options.voices)

    def count_tokens(self, text: str) -> int:
        """LLM tokens of ``text`` (usage's input tokens)."""
        return len(self.model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def validate(self, request: SpeechRequest) -> None:
        text = request.text
        if not text or not text.strip():
            raise InvalidRequestError("text must not be empty", "text")
        if len(text) > MAX_TEXT_CHARS:
            raise InvalidRequestError(f"text is longer than {MAX_TEXT_CHARS} characters", "text",
                                      code="text_too_long")
        if request.mode not in self.modes:
            raise InvalidRequestError(f"unknown mode {request.mode!r}", "mode")
        if request.mode == "read" and not has_speakable_text(text):
            raise InvalidRequestError("text holds nothing speakable (no letters or digits)", "text",
                                      code="nothing_to_speak")
        if request.voice not in self.options.voices:
            raise InvalidRequestError(f"unknown voice {request.voice!r}", "voice",
                                      code="unknown_voice")
        if request.speed != 1.0:
            raise InvalidRequestError("this engine speaks at speed 1.0 only", "speed")
        request.sampling.validate()
        prompt_tokens = len(self.model.tokenizer(self._prompt_text(request),
                                                  add_special_tokens=False)["input_ids"])
        prompt_tokens += len(self._gen_prompt_ids)
        if request.mode == "chat":
            budget = self.options.llm_max_positions - prompt_tokens
            if budget < PIECE_TOKENS + 1:
                raise InvalidRequestError("text is too long for a chat turn", "text",
                                          code="text_too_long")

    def _prompt_text(self, request: SpeechRequest) -> str:
        if request.mode == "read":
            return user_turn(READ_INSTRUCTION + request.text, request.system_prompt)
        return user_turn(request.text, request.system_prompt)

    def plan(self, request: SpeechRequest) -> StreamPlan:
        prompt = self._prompt_text(request)
        if request.mode == "read":
            ids = self.model.tokenizer(request.text, add_special_tokens=False)["input_ids"]
            return StreamPlan(request, prompt, cut_into_pieces(ids, self.model.tokenizer.decode))
        return StreamPlan(request, prompt, None)

    def submit(self, requests: list[SpeechRequest]) -> list[AsyncIterator[AudioChunk]]:
        for request in requests:
            self.validate(request)
        return self.submit_plans([self.plan(r) for r in requests])

    def submit_plans(self, plans: Sequence[StreamPlan]) -> list[AsyncIterator[AudioChunk]]:
        """Admit prepared plans (the golden tests feed upstream's exact prompt and pieces)."""
        loop = asyncio.get_running_loop()
        streams = [_Stream(plan, asyncio.Queue(), loop, time.perf_counter()) for plan in plans]
        with self._lock:
            if len(self._pending) + len(streams) > self.options.max_queued:
                raise EngineOverloadedError("engine queue is full")
            for stream in streams:
                if stream.request_id in self._active or any(
                        s.request_id == stream.request_id for s in self._pending):
                    raise InvalidRequestError("duplicate request id", "request_id")
            self._pending.extend(streams)
        self._wake.set()
        return [self._iterate(stream) for stream in streams]

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        with self._lock:
            self._stats.active_streams = len(self._active)
            self._stats.queued_streams = len(self._pending)
            return EngineStats(**self._stats.as_dict())

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
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    async def _iterate(self, stream: _Stream) -> AsyncIterator[AudioChunk]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.final:
                    return
        finally:
            if not stream.done:
                self.abort(stream.request_id)

    # ---- step loop -------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            if not self._active and not self._pending and not self._aborts:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as error:  # one bad step must not kill the loop; fail its streams
                logger.exception("engine step failed")
                for stream in list(self._active.values()):
                    self._fail(stream, EngineError(f"engine step failed: {type(error).__name__}"))

    def _phase(self, name: str, started: float) -> float:
        """Account the time since ``started`` to phase ``name`` (synchronising when profiling)."""
        if not self.options.profile_phases:
            return started
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self._phase_s[name] += now - started
        return now

    def phase_seconds(self) -> dict[str, float]:
        return dict(self._phase_s)

    def _step(self) -> None:
        step = next(self._step_counter)
        t = time.perf_counter()
        self._apply_aborts()
        if self._faults is not None:
            self._inject_faults()
        self._admit(step)
        t = self._phase("admit_prefill", t)
        self._llm_decode()
        t = self._phase("llm_decode", t)
        prefills: list[tuple[_Stream, object]] = []
        for stream in list(self._active.values()):
            self._advance_text(stream, prefills)
        t = self._phase("schedule", t)
        self._run_tts_prefills(prefills)
        t = self._phase("tts_prefill", t)
        generating = [s for s in self._active.values()
                      if s.schedule is not None and s.schedule.phase is Phase.GENERATING]
        decode_jobs: list[tuple[_Stream, DecodeJob]] = []
        follow_up: list[tuple[_Stream, object]] = []
        if generating:
            self._tts_step(generating, decode_jobs, follow_up)
        t = self._phase("tts_step", t)
        self._run_tts_prefills(follow_up)
        t = self._phase("tts_prefill", t)
        self._decode(decode_jobs)
        for stream in list(self._active.values()):
            if stream.schedule is not None and stream.schedule.phase is Phase.DONE:
                self._complete(stream)
        self._phase("decode_emit", t)
        with self._lock:
            self._stats.steps += 1
            self._stats.last_batch_size = len(generating)
            self._stats.max_batch_size_seen = max(self._stats.max_batch_size_seen, len(generating))

    # ---- admission and release -------------------------------------------------------------

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            kept = collections.deque()
            for stream in self._pending:
                if stream.request_id in aborts:
                    self._stats.aborted += 1
                    self._send(stream, RequestAbortedError("aborted"))
                    stream.done = True
                else:
                    kept.append(stream)
            self._pending = kept
        for request_id in aborts:
            stream = self._active.get(request_id)
            if stream is not None:
                self._release(stream)
                stream.done = True
                self._send(stream, RequestAbortedError("aborted"))
                with self._lock:
                    self._stats.aborted += 1

    def _inject_faults(self) -> None:
        """Fault injection (tests only): fail or crash streams whose text holds a marker."""
        assert self._faults is not None
        for stream in list(self._active.values()):
            action = self._faults.action(stream.plan.request.text, stream.chunks_sent)
            if action == "crash":
                crash_process(stream.request_id)
            elif action == "fail":
                logger.error("request %s failed: injected fault", stream.request_id)
                self._fail(stream, EngineError("speech synthesis failed (injected fault)"))

    def _admit(self, step: int) -> None:
        if self._active and step % max(self.options.admission_interval_steps, 1):
            return  # batch admissions: one LLM prefill per few steps instead of one per step
        admitted: list[_Stream] = []
        with self._lock:
            while self._pending and self._free_slots:
                stream = self._pending[0]
                if stream.plan.pieces is None and not self._free_llm_slots:
                    break
                self._pending.popleft()
                stream.slot = heapq.heappop(self._free_slots)
                if stream.plan.pieces is None:
                    stream.llm_slot = heapq.heappop(self._free_llm_slots)
                admitted.append(stream)
        if not admitted:
            return
        for stream in admitted:
            self._active[stream.request_id] = stream
            self.tts_cache.clear_slot(stream.slot, upto=self.model.config.tts.condition_length)
        try:
            self._prefill_llm(admitted)
        except Exception as error:
            logger.exception("prefill failed")
            for stream in admitted:
                self._fail(stream, EngineError(f"prefill failed: {type(error).__name__}"))
            return
        for stream in admitted:
            self._init_schedule(stream)

    def _init_schedule(self, stream: _Stream) -> None:
        request = stream.plan.request
        cfg = self.model.config.tts
        lengths = request.lengths
        frame_limit = lengths.audio_frames
        if request.max_audio_s is not None:
            cap = int(request.max_audio_s * SAMPLE_RATE_HZ / SAMPLES_PER_FRAME)
            frame_limit = cap if frame_limit is None else min(frame_limit, cap)
        stts = self._stts_id
        tokenizer = self.model.tts_tokenizer
        stream.schedule = SpeechSchedule(
            config=cfg,
            tokenize=lambda text: tokenizer.encode(text, add_special_tokens=False),
            decode_tokens=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False),
            chunk_frames=self.options.chunk_frames,
            max_segment_frames=self.options.max_segment_frames,
            max_positions=self.options.tts_max_positions,
            ignore_eos=lengths.ignore_eos or lengths.audio_frames is not None,
            total_frame_limit=frame_limit,
            stts_id=stts)
        stream.joiner = StreamingAudioJoiner()
        if stream.plan.pieces is not None:
            stream.pieces.extend(stream.plan.pieces)
            stream.text_done = True

    def _release(self, stream: _Stream) -> None:
        self._active.pop(stream.request_id, None)
        with self._lock:
            if stream.slot >= 0:
                heapq.heappush(self._free_slots, stream.slot)
            if stream.llm_slot >= 0:
                heapq.heappush(self._free_llm_slots, stream.llm_slot)
        stream.slot = stream.llm_slot = -1

    def _fail(self, stream: _Stream, error: BaseException) -> None:
        if stream.done:
            return
        self._release(stream)
        stream.done = True
        with self._lock:
            self._stats.failed += 1
        self._send(stream, error)

    def trace(self, request_id: str) -> SpeechSchedule | None:
        """The finished schedule of a stream (only with ``keep_traces``)."""
        return self._traces.get(request_id)

    def _complete(self, stream: _Stream) -> None:
        if self.options.keep_traces and stream.schedule is not None:
            self._traces[stream.request_id] = stream.schedule
        tail = stream.joiner.finish() if stream.joiner is not None else np.zeros(0, np.float32)
        self._release(stream)
        self._emit(stream, tail, final=True)
        stream.done = True
        with self._lock:
            self._stats.completed += 1

    def _send(self, stream: _Stream, item: object) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone; nobody is listening
            pass

    def _emit(self, stream: _Stream, samples: np.ndarray, final: bool = False) -> None:
        if len(samples) == 0 and not final:
            return
        now = time.perf_counter()
        timings = {}
        if stream.first_audio_at is None and len(samples):
            stream.first_audio_at = now
            timings["ttfb_s"] = now - stream.submitted_at
        if final:
            timings.update(total_s=now - stream.submitted_at, tts_steps=float(stream.tts_steps),
                           llm_tokens=float(stream.llm_tokens))
        text = stream.schedule.text_since_emit if stream.schedule is not None else ""
        if stream.schedule is not None:
            stream.schedule.text_since_emit = ""
        stream.samples_out += len(samples)
        stream.chunks_sent += 1
        self._send(stream, AudioChunk(stream.request_id, samples.astype(np.float32, copy=False),
                                      SAMPLE_RATE_HZ, text=text, final=final, timings_s=timings))

    # ---- LLM ---------------------------------------------------------------------------------

    def _prefill_llm(self, streams: list[_Stream]) -> None:
        """Prefill the prompts of newly admitted streams (up to 8 per pass): every stream gets its
        speaker embedding; chat streams keep their keys and values in their LLM slot and sample
        their first token."""
        tok = self.model.tokenizer
        prompts = [tok(s.plan.prompt, add_special_tokens=False)["input_ids"] + self._gen_prompt_ids
                   for s in streams]
        for start in range(0, len(streams), 8):
            self._prefill_pass(streams[start:start + 8], prompts[start:start + 8])

    def _prefill_pass(self, streams: list[_Stream], prompts: list[list[int]]) -> None:
        longest = max(len(p) for p in prompts)
        batch = len(streams)
        ids = torch.zeros(batch, longest, dtype=torch.long)
        valid = torch.zeros(batch, longest, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            valid[i, : len(p)] = True
        graphs = self._llm_prefill_graphs
        if graphs is not None and graphs.fits(batch, longest):
            hidden = graphs.run(ids, valid)
            cache = graphs.cache
        else:
            cache = SlotKVCache(self.model.config.llm, batch, longest, self.device, self.dtype)
            hidden = llm_prefill(self.model.llm, cache, ids.to(self.device), valid.to(self.device),
                                 torch.arange(batch, device=self.device), True)
        every = torch.arange(batch, device=self.device)
        spk_index = torch.tensor([max(i for i, t in enumerate(p) if t == self._spk_id) for p in prompts],
                                 device=self.device)
        speakers = self.model.tts.speaker_embedding(hidden[every, spk_index])
        for i, stream in enumerate(streams):
            stream.speaker = speakers[i]
        chat = [i for i, s in enumerate(streams) if s.plan.pieces is None]
        if not chat:
            return
        # the chat prompts stay in their LLM slots for decoding: one copy per layer for all of
        # them (positions past a prompt's end are rewritten by decoding before any query sees them)
        rows = torch.tensor(chat, device=self.device)
        slots = torch.tensor([streams[i].llm_slot for i in chat], device=self.device)
        longest_chat = max(len(prompts[i]) for i in chat)
        for source, target in ((cache.keys, self.llm_cache.keys), (cache.values, self.llm_cache.values)):
            for layer_source, layer_target in zip(source, target):
                layer_target[slots, :, :longest_chat] = layer_source[rows, :, :longest_chat]
        last = torch.tensor([len(prompts[i]) - 1 for i in chat], device=self.device)
        logits = self.model.llm.logits(hidden[torch.tensor(chat, device=self.device), last])
        chat_streams = [streams[i] for i in chat]
        for i, stream in zip(chat, chat_streams):
            stream.llm_len = len(prompts[i])
            stream.penalty_window = list(self._gen_prompt_ids)
            stream.piece_decoder = PieceDecoder(self.model.tokenizer.decode, self._terminators)
        tokens = self._sample_llm(chat_streams, logits)
        for stream, token in zip(chat_streams, tokens):
            self._accept_token(stream, token)

    def _sample_llm(self, streams: list[_Stream], logits: torch.Tensor) -> list[int]:
        """Sample the first token from prefill logits with the decode step's processors."""
        x = self._llm_inputs(streams)
        x = LLMStepInputs(**{f: getattr(x, f).to(self.device) for f in LLMStepInputs.__dataclass_fields__})
        return sample_next_token(logits, x).tolist()

    def _accept_token(self, stream: _Stream, token: int) -> None:
        """A sampled LLM token: group by 3 into pieces, stop at terminators or the limit."""
        request = stream.plan.request
        fixed = request.lengths.llm_tokens
        stream.llm_tokens += 1
        stream.group.append(token)
        stream.penalty_window.append(token)
        stream.next_token = token
        terminated = fixed is None and (token in self._terminators or token == self._tts_eos_id)
        limit = fixed if fixed is not None else request.sampling.max_new_tokens
        if len(stream.group) == PIECE_TOKENS or terminated or stream.llm_tokens >= limit:
            piece = stream.piece_decoder.push(stream.group)
            stream.pieces.append(piece)
            stream.penalty_window = [token]  # upstream penalises only the current call's ids
            stream.group = []
            if terminated or stream.llm_tokens >= limit or stream.llm_len + 1 >= self.options.llm_max_positions:
                stream.text_done = True
                self._free_llm_slot(stream)

    def _free_llm_slot(self, stream: _Stream) -> None:
        with self._lock:
            if stream.llm_slot >= 0:
                heapq.heappush(self._free_llm_slots, stream.llm_slot)
        stream.llm_slot = -1

    def _llm_decode(self) -> None:
        """One batched LLM step for every chat stream below its lookahead; more steps (up to
        ``steps_per_sync``) while a stream's speech waits for its next piece."""
        for _ in range(self._window):
            streams = [s for s in self._active.values()
                       if s.plan.pieces is None and not s.text_done and s.llm_slot >= 0
                       and s.schedule is not None and len(s.pieces) < self.options.llm_lookahead_pieces]
            if not streams:
                return
            self._llm_decode_step(streams)
            if not any(not s.pieces and not s.text_done and s.schedule.phase is Phase.WAITING_TEXT
                       for s in streams):
                return

    def _llm_decode_step(self, streams: list[_Stream]) -> None:
        inputs = self._llm_inputs(streams)
        slots = [s.llm_slot for s in streams]
        if self._llm_graphs is not None:
            tokens = self._llm_graphs.run(slots, inputs)
        else:
            device_inputs = LLMStepInputs(**{f: getattr(inputs, f).to(self.device)
                                             for f in LLMStepInputs.__dataclass_fields__})
            tokens = llm_decode_step(self.model.llm, self.llm_cache, device_inputs,
                                     torch.tensor(slots, device=self.device), False).cpu()
        for stream in streams:
            stream.llm_len += 1
            stream.llm_steps += 1
        for stream, token in zip(streams, tokens.tolist()):
            self._accept_token(stream, token)

    def _llm_inputs(self, streams: list[_Stream]) -> LLMStepInputs:
        params = [s.plan.request.sampling for s in streams]
        width = self._penalty_width
        window = np.zeros((len(streams), width), dtype=np.int64)
        for row, stream in enumerate(streams):
            ids = stream.penalty_window[-width:]
            window[row, :len(ids)] = ids
            window[row, len(ids):] = ids[0]
        return LLMStepInputs(
            token=torch.tensor([s.next_token or 0 for s in streams]),
            position=torch.tensor([s.llm_len for s in streams]),
            active=torch.ones(len(streams), dtype=torch.bool),
            temperature=torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params]),
            top_p=torch.tensor([p.top_p for p in params]),
            top_k=torch.tensor([p.top_k for p in params]),
            penalty=torch.tensor([p.repetition_penalty for p in params]),
            greedy=torch.tensor([p.temperature == 0 for p in params]),
            seed=torch.tensor([s.plan.request.seed or 0 for s in streams]),
            counter=torch.tensor([s.llm_tokens for s in streams]),
            window=torch.from_numpy(window))

    # ---- TTS ---------------------------------------------------------------------------------

    def _advance_text(self, stream: _Stream, work: list) -> None:
        schedule = stream.schedule
        if schedule is None:
            return
        while schedule.phase is Phase.WAITING_TEXT:
            if stream.pieces:
                items = schedule.accept_piece(stream.pieces.popleft())
            elif stream.text_done:
                items = schedule.end_of_text()
            else:
                return
            work.extend((stream, item) for item in items)
            if schedule.phase is Phase.DONE:
                return

    def _run_tts_prefills(self, work: list[tuple[_Stream, object]]) -> None:
        texts = []
        for stream, item in work:
            if stream.done or stream.slot < 0:
                continue
            if item == "reset_cache":
                self.tts_cache.clear_slot(stream.slot, upto=self.model.config.tts.condition_length)
            elif isinstance(item, TextPrefill):
                texts.append((stream, item))
            elif isinstance(item, CarryPrefill):
                if texts:
                    self._text_prefill(texts)
                    texts = []
                self._carry_prefill(stream, item)
        if texts:
            self._text_prefill(texts)

    def _text_prefill(self, items: list[tuple[_Stream, TextPrefill]]) -> None:
        """Batched text prefill in passes of :data:`PREFILL_TOKENS` tokens (causal, so a long
        prefill split in passes writes exactly what one pass would)."""
        cfg = self.model.config.tts
        width = PREFILL_TOKENS
        passes = max((len(item.token_ids) + width - 1) // width for _, item in items)
        for index in range(passes):
            batch = [(s, item) for s, item in items if len(item.token_ids) > index * width]
            ids = np.zeros((len(batch), width), dtype=np.int64)
            positions = np.zeros((len(batch), width), dtype=np.int64)
            valid = np.zeros((len(batch), width), dtype=bool)
            speaker_at = np.zeros((len(batch), width), dtype=bool)
            for row, (_, item) in enumerate(batch):
                part = item.token_ids[index * width:(index + 1) * width]
                start = item.start + index * width
                ids[row, :len(part)] = part
                positions[row, :len(part)] = np.arange(start, start + len(part))
                valid[row, :len(part)] = True
                if item.with_speaker:
                    speaker_at[row, :len(part)] = np.asarray(part) == cfg.spk_emb_token_id
            tensors = [torch.from_numpy(a) for a in (ids, positions, valid, speaker_at)]
            speaker = torch.stack([s.speaker for s, _ in batch])
            slots = [s.slot for s, _ in batch]
            if self._prefill_graphs is not None:
                self._prefill_graphs.run(slots, tensors[0], tensors[1], tensors[2], speaker, tensors[3])
            else:
                ids_t, positions_t, valid_t, speaker_at_t = (t.to(self.device) for t in tensors)
                text_prefill_step(self.model.tts, self.tts_cache, ids_t, positions_t, valid_t, speaker,
                                  speaker_at_t, torch.tensor(slots, device=self.device), False)

    def _carry_prefill(self, stream: _Stream, item: CarryPrefill) -> None:
        tts = self.model.tts
        cfg = self.model.config.tts
        frames = torch.tensor(item.frames[:-1], dtype=torch.long, device=self.device).view(-1, cfg.num_vq)
        bos = tts.emb_text(torch.tensor([cfg.audio_bos_token_id], device=self.device))
        embeds = torch.cat([bos, tts.code_embedding(frames)], dim=0)[None]
        count = embeds.shape[1]
        positions = torch.arange(cfg.audio_bos_position, cfg.audio_bos_position + count,
                                 device=self.device)[None]
        text_len = len(stream.schedule.text_ids)
        keys = torch.arange(self.tts_cache.max_positions + 1, device=self.device)
        row = audio_visibility(keys, torch.tensor([cfg.audio_bos_position + count - 1], device=self.device),
                               torch.tensor([cfg.audio_bos_position], device=self.device),
                               torch.tensor([text_len], device=self.device), cfg)
        attend = row[:, None, None, :].expand(1, 1, count, row.shape[-1])
        rows = torch.tensor([stream.slot], device=self.device)
        tts(embeds, self.tts_cache, StepInputs(rows, positions, positions, attend))

    def _tts_step(self, streams: list[_Stream], decode_jobs: list, follow_up: list) -> None:
        """One window of up to ``steps_per_sync`` audio frames per stream, then the schedule
        replays each stream's frames in order (its call ends exactly where the device stopped)."""
        cfg = self.model.config.tts
        greedy = int(self.options.tts_sampling == "greedy")
        packed = np.zeros((len(streams), PACKED_COLUMNS), dtype=np.int64)  # numpy: cheap per-item writes
        for i, stream in enumerate(streams):
            st = stream.schedule.next_step()
            row = packed[i]
            row[ACTIVE], row[BOS] = 1, st.bos
            if st.frame is not None:
                row[FRAME0:FRAME0 + cfg.num_vq] = st.frame
            row[POSITION], row[TEXT_LEN] = st.position, st.text_len
            row[CALL_FRAMES], row[EOS_AFTER], row[STEPS_LEFT] = st.call_frames, st.eos_after, st.steps_left
            row[WARP] = st.apply_warpers
            row[SEED], row[COUNTER] = stream.plan.request.seed or 0, stream.tts_steps
            row[GREEDY] = greedy
        packed = torch.from_numpy(packed)
        slots = [s.slot for s in streams]
        if self._graphs is not None:
            window = self._graphs.run(slots, packed)
        else:
            rows = torch.tensor(slots, device=self.device)
            span = attention_span(packed, self._window, self._spans)
            window = audio_window(self.model.tts, self.tts_cache, packed.to(self.device), rows, False,
                                  self._window, span).cpu()
        made = window[:, :, -1].sum(dim=0).tolist()
        codes = window[:, :, :-1].permute(1, 0, 2).tolist()  # [B][steps][vq]
        for stream, count, frames in zip(streams, made, codes):
            for frame in frames[:count]:
                stream.tts_steps += 1
                for item in stream.schedule.on_frame(frame):
                    if isinstance(item, DecodeJob):
                        decode_jobs.append((stream, item))
                    else:
                        follow_up.append((stream, item))

    def _decode(self, jobs: list[tuple[_Stream, DecodeJob]]) -> None:
        real = [(s, j) for s, j in jobs if j.frames and not s.done]
        if real:
            codes = [torch.tensor(j.frames, dtype=torch.long) for _, j in real]
            waves = self._decoder.decode(codes)
            lengths = [len(w) for w in waves]
            flat = torch.cat([w.float() for w in waves]).cpu().numpy()  # one device-to-host copy
            offsets = np.cumsum([0] + lengths)
            for index, (stream, job) in enumerate(real):
                audio = flat[offsets[index]:offsets[index + 1]]
                if job.segment_start:
                    tail = stream.joiner.finish()
                    if len(tail):
                        self._emit(stream, tail)
                    stream.joiner.reset()
                self._emit(stream, stream.joiner.push(audio))
        for stream, job in jobs:
            if job.last_of_segment and not stream.done:
                tail = stream.joiner.finish()
                stream.joiner.reset()
                if len(tail):
                    self._emit(stream, tail)

