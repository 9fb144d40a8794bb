"""The MiniCPM-o engine's configuration (``engine_options`` in serve_config.yaml).

Free of torch: ``serve run`` checks these options (names, types, values) when it builds the app
(:class:`serve_app.config.AppArgs`), before any replica starts; the engine resolves them with torch
(:mod:`.device.placement`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StrictBool
from pydantic.dataclasses import dataclass

from ..raw_options import options_from_raw
from .model.names import (
    DECODE_DTYPE_NAMES,
    DEFAULT_MODEL_ID,
    KV_CACHE_DTYPES,
    MODEL_DTYPE_NAMES,
    ONE_QUERY_KERNELS,
    check_quantization,
)

Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class EngineOptions:
    """Engine configuration (``engine_options`` in serve_config.yaml); a typo'd name, a wrong
    type or a value out of range is a :class:`ValueError` (pydantic's ``ValidationError``)."""

    model: str = DEFAULT_MODEL_ID
    revision: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    # streams running at once, read and chat: each holds a TTS slot, a chat stream also an LLM
    # slot (max_chat_slots of them); more wait in the engine's queue (max_queued). The
    # Synthesizer's max_ongoing_requests is max_slots (serve_app.app.build_app)
    max_slots: Positive = 64
    max_chat_slots: NonNegative = 32
    max_queued: NonNegative = 256
    # who gets a slot: "work" admits a stream only while the engine's projected step stays
    # inside its real-time budget less admission_margin, each kind's cost measured as the
    # engine runs; what does not fit is refused at once (503, Retry-After), and a queued stream
    # is refused once its first audio could no longer come within first_audio_deadline_s
    # (serve_app/engines/work_admission.py). "slots": any free slot admits and the queue waits
    # (the rule before; past capacity every stream turns late)
    admission: Literal["work", "slots"] = "work"
    admission_margin: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.5
    first_audio_deadline_s: Annotated[float, Field(gt=0.0)] = 0.5
    # admitting by work, the longest a queued stream waits for its slot before it is refused
    # (reason "wait"), whatever its deadline leaves; at least one step. None: the deadline alone.
    # 0.1 in the GPU profiles: engine alone on an H200, read 2x / 3x, refusals p99 72 / 75 ms
    # (157 / 184 ms before it, another lease; docs/operations.md)
    max_queue_wait_s: Annotated[float, Field(gt=0.0)] | None = None
    # admitting by work, a step where a stream's audio came after its listener had played all
    # it had stops admission for this long: new streams are refused (reason "behind"), queued
    # ones wait; 0 never holds (work_admission.py, "Behind")
    behind_hold_s: Annotated[float, Field(ge=0.0)] = 0.0
    # admitting by work, a step that left thin listeners uncut starts no queued stream at the
    # next (a new one's projected wait counts that step); False: the queue starts anyway, and
    # only the work limit and the holds above pace new streams (work_admission.py, "Behind").
    # Served 3x on an H200 (cf7b732): false took refusals' p99 in the replica from 84-118 ms
    # to 50-90 ms, but mixed kept 99.1 % of what it admitted real-time, not 100 %
    thin_listeners_hold_queue: bool = True
    tts_max_positions: Positive = 1536
    llm_max_positions: Positive = 2048
    chunk_frames: Positive = 25
    # the shortest first audio chunk, in code frames: a stream's first generate call is also
    # decoded and sent at this many frames, so the first audio waits for fewer engine steps
    # (10 frames are 2 steps where 25 are 5); while its buffer is thin, its audio is also cut at
    # the end of later steps (step/first_chunk.py). The codes are upstream's either way; only
    # the audio is cut, and crossfaded at each cut as at every piece boundary (docs/minicpmo.md,
    # "A smaller first chunk"). None: chunk_frames, upstream's pieces to 1e-6
    first_chunk_frames: Annotated[int, Field(ge=5)] | None = None
    # plan each stream's first chunk and the cuts after it from the engine's recent step time,
    # so the listener's buffer never runs dry (step/first_chunk.py). False: always exactly
    # first_chunk_frames and whole calls after it, whatever the load (tests)
    first_chunk_follows_load: StrictBool = True
    # how the cuts after the first chunk are made: "planned" at admission from the recent step
    # time (step/first_chunk.py), or "on_demand" with the clock, whenever a listener runs thin
    # (step/audio_cuts.py: a shorter TTFB, not yet every stream real-time)
    audio_cuts: Literal["planned", "on_demand"] = "planned"
    # on_demand: at most this many streams cut a step, the thinnest first (step/audio_cuts.py):
    # each piece costs decode and host time, and cutting every thin stream on an engine that
    # slows down slows it further (uncapped, at 1024 read streams on an H100: decode_emit 19.6
    # ms a step, 7.6 ms with planned cuts on another H100)
    thin_cuts_per_step: Positive = 32
    tts_sampling: str = "sample"  # "greedy" makes codes independent of the batch
    max_segment_frames: Positive = 2048
    voices: StrictBool = True  # voice cloning: loads the audio encoder (apm) if the checkpoint has one
    max_voices: Positive = 32  # cloned voices kept loaded (LRU); each holds its prompt's LLM keys/values
    served_model_name: str = "MiniCPM-o-2_6"  # what /v1/models shows (never a local path)
    keep_traces: StrictBool = False  # tests: keep each finished stream's codes (see ``trace``)
    cuda_graphs: StrictBool = True  # replay the TTS audio step and the decode as CUDA graphs
    profile_phases: StrictBool = False  # benchmarks: time each phase of the step (adds GPU syncs)
    llm_lookahead_pieces: Positive = 2  # chat: decode ahead of the TTS by at most this many pieces
    # streamed text: after this long without new text, speech that waits for more speaks the
    # text up to its last break (streamed_text.py) instead. Above the gaps of a text that
    # streams at 5 words/s or faster, so an LLM's answer is cut only where it really pauses;
    # each cut ends an utterance there (a sentence's fall at a comma)
    text_break_wait_s: float = 0.25
    # chat: while audio is generated, launch the LLM step before the audio window and take its
    # tokens after it (on CUDA on a stream of its own, so the two overlap; its graphs are
    # captured on a stream of their own, graphs.py); while a stream waits for text, its further
    # steps run beside the window too, not in line before it: on an H100 chat 128 TTFB p99 367
    # against 482 ms in line, chat 160 real-time (docs/benchmarks/README.md, "Before: read 576
    # and chat 160"); on in serve_config.yaml
    overlap_llm_step: StrictBool = False
    # the admission prefill of streams admitted while the device runs the audio window (a busy
    # engine's admissions) on the LLM step's CUDA stream, beside the window, not queued behind
    # it; the window keeps the device's highest priority. The same kernels on the same inputs
    # (the prefill graphs are captured on a stream of their own, graphs.py): scheduling only
    prefill_beside_window: StrictBool = False
    # with it, the prefill on a CUDA stream of its own (its graphs captured on one of their own),
    # beside the LLM steps as well, which then no longer queue behind it; for the A/B
    prefill_stream_of_its_own: StrictBool = False
    # with it, the chat streams it admits get their first text in the same step: their first
    # tokens are taken after the LLM step beside the window (which the prefill already waits
    # behind on the LLM stream), before the further LLM steps for streams waiting for text, which
    # then include them; without it those tokens are taken at the next step's start and the new
    # streams' first text comes a step later. The same tokens: scheduling only. Off: engine
    # alone on an H200 (7e6f8ee), 480 read + 160 chat, two runs each, on against off: 62.8 / 42.3
    # against 82.0 / 71.9 % real-time, chat first audio p99 649 / 750 against 689 / 740 ms; the
    # admission step's extra LLM steps (2.15 against 1.83 a step) lengthened the step
    first_text_beside_window: StrictBool = False
    # the audio window's rows in its CUDA graphs: "generating", one row per stream that makes
    # audio this step (with visible_ranges attention, which finds each row's slot itself; other
    # kernels slice the cache, so they keep "slot_range"), or "slot_range", every slot below the
    # highest generating one. The same per-row math either way (bf16 results already vary with
    # the batch's size: batch-invariance-h200.json). Engine alone on an H200 at 576 read + 192
    # chat: 1.07 rows computed per frame made against 1.62, the window's phase 18.7 against
    # 23.3 ms a step, the step 0-4 % shorter (docs/benchmarks/README.md, "The audio window's rows")
    audio_window_rows: Literal["generating", "slot_range"] = "generating"
    # the chat LLM step's rows in its CUDA graphs, the same choice: "streams", one row per chat
    # stream that takes a token this step (with visible_ranges attention), or "slot_range", every
    # LLM slot below the highest of them. A chat stream keeps its LLM slot until its text ends,
    # and a step's rows are only those below their lookahead. Engine alone on an H200 (afdd2de),
    # two pairs: 23 against 83 rows a LLM step; 480 read + 160 chat 72.0 / 93.5 against 46.2 /
    # 55.2 % real-time, step 60.1 / 59.2 against 67.5 / 65.6 ms (docs/benchmarks/README.md)
    llm_step_rows: Literal["streams", "slot_range"] = "streams"
    steps_per_sync: Positive = 5  # audio frames per engine step, chained on the device (one host sync);
    # a divisor of chunk_frames keeps every generate call aligned to engine steps
    # decode-step attention of the TTS: sdpa | matmul | flex | visible_ranges (layers.py). flex
    # reads only the key blocks each row sees (1.3-1.7x faster audio frames at 128-512 streams
    # on an H100) but compiles each captured batch shape at start (10-19 s each);
    # visible_ranges reads only the keys each row sees, two ranges per row, with a Triton
    # kernel on CUDA (model/range_attention.py), for the chat LLM's decode step too (flex: the
    # LLM keeps sdpa). The LLM's next-token distribution moves by KL 0.0037 nats at temperature
    # 0.7 on full-size random weights (p99 0.0050; two SDPA paths: 0.0008), 9e-6 on the tiny
    # checkpoint; trained weights unmeasured (docs/benchmarks/llm-attention-numerics.json)
    one_query_attention: str = "sdpa"
    # DVAE + Vocos weights and activations: float32 (upstream's output to 1e-6) or bfloat16
    # (2.3-2.8x faster on an H100; its error: docs/benchmarks/README.md, "DVAE + Vocos in bf16");
    # the inverse STFT runs in float32 either way
    decode_dtype: str = "float32"
    # the TTS model's keys and values: auto (the model's dtype) or fp8_e4m3 (e4m3 numbers and a
    # float32 scale per key and value vector, model/kv_cache.py): a slot holds 34 MB, not 63,
    # so an H100 holds 896 TTS + 256 chat slots (read 832 real-time, engine alone). Off by
    # default: on full-size random weights it moves the sampled next-code distribution by
    # KL 0.0098 nats on average (rounding alone: 0.0011) and agrees with bf16's greedy code
    # 92.4 % of the time (rounding alone: 97.4 %); trained weights are unmeasured
    # (docs/benchmarks/kv-fp8-numerics.json, README "The TTS KV cache in fp8")
    tts_kv_cache_dtype: str = "auto"
    fuse_projections: StrictBool = True  # q/k/v and gate/up as one matmul each (unquantized layers)
    admission_interval_steps: Positive = 1  # while streams run, admit every N engine steps
    # padded prompt tokens (prompts x the longest) admitted and prefilled per engine step, as
    # vLLM's max_num_batched_tokens: a burst of short prompts is one pass (every pass reads all
    # the LLM's weights), long ones spread over steps, a prompt over the budget runs alone
    prefill_tokens: Positive = 4096
    # prompts admitted and prefilled per engine step, at most: the admission prefill's CUDA
    # graphs are captured for batches up to it; a larger admission ran eagerly, and such steps
    # took 0.2-1.3 s at 256-320 read streams on an H100 (docs/benchmarks/README.md)
    prefill_prompts: Positive = 8
    # the admission prefill's prompts packed into one row, each attending to its own tokens
    # (device/packed_prefill.py), not padded to the longest and to graph buckets: the same
    # computation on fewer tokens, but other matmul shapes, so other rounding (as a batch's
    # size already brings: batch-invariance-h200.json). Prompts in a cloned voice stay padded.
    # Off until measured: on the tiny checkpoint in float32 it moves logits, speaker embeddings
    # and keys no more than a batch's shape does (bench/accuracy/packed_prefill.py; tests in
    # test_packed_prefill.py). On an H200, one pair at 480 read + 160 chat (afdd2de): step 50.7
    # against 53.3 ms, both 100 % real-time, inside one lease's spread; its drift in bf16 on
    # full-size weights not measured yet; trained weights cannot be loaded here
    packed_prefill: StrictBool = False
    quantization: str = "none"  # LLM linears: none | int8 | int4 | int4-tinygemm (quantization.py)
    gpu_memory_gb: float | None = None  # cap this engine's CUDA allocations (1e9 bytes), as a
    # smaller GPU would: the A10G profile's 22 leaves an A10G's CUDA context room
    fault_injection: dict | None = None  # tests only: fail/crash markers (see engines/faults.py)
    benchmark: dict | None = None  # benchmarks only: random weights, fixed lengths (benchmark_mode.py)

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        if self.one_query_attention not in ONE_QUERY_KERNELS:
            raise ValueError(f"one_query_attention must be one of {ONE_QUERY_KERNELS}")
        if self.decode_dtype not in DECODE_DTYPE_NAMES:
            raise ValueError(f"decode_dtype must be one of {sorted(DECODE_DTYPE_NAMES)}")
        if self.tts_kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"tts_kv_cache_dtype must be one of {KV_CACHE_DTYPES}")
        if self.dtype not in MODEL_DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPE_NAMES}")
        if self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0:
            raise ValueError("gpu_memory_gb must be a positive number of gigabytes")
        if self.first_chunk_frames is not None and self.first_chunk_frames > self.chunk_frames:
            raise ValueError(f"first_chunk_frames ({self.first_chunk_frames}) must be at most "
                             f"chunk_frames ({self.chunk_frames})")
        if not self.text_break_wait_s >= 0:
            raise ValueError("text_break_wait_s must be 0 or more seconds")

    @property
    def max_held(self) -> int:
        """Streams the engine holds at most: in its slots or its queue."""
        return self.max_slots + self.max_queued

    @property
    def first_chunk_lengths(self) -> list[int]:
        """A first chunk's possible lengths inside a call: ``first_chunk_frames``, then each
        step's end (``steps_per_sync``) before the call's (empty: whole calls)."""
        lengths, frames = [], self.first_chunk_frames or self.chunk_frames
        while frames < self.chunk_frames:
            lengths.append(frames)
            frames = (frames // self.steps_per_sync + 1) * self.steps_per_sync
        return lengths

    @classmethod
    def from_raw(cls, raw: dict[str, object]) -> "EngineOptions":
        """Options from a plain mapping (serve_config.yaml); unknown keys are an error."""
        return options_from_raw(cls, raw)


def clones_voices(model, options: EngineOptions) -> bool:
    """Voice cloning is on: ``voices`` asks for it and the model has its audio encoder."""
    return options.voices and getattr(model, "clip_encoder", None) is not None
