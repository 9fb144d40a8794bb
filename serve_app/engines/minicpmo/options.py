"""The MiniCPM-o engine's configuration (``engine_options`` in serve_config.yaml)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model.layers import ONE_QUERY_KERNELS
from .model.loader import DEFAULT_MODEL_ID
from .model.quantization import check_mode as check_quantization


DECODE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    voices: bool = True  # voice cloning: loads the audio encoder (apm) if the checkpoint has one
    max_voices: int = 32  # cloned voices kept loaded (LRU); each holds its prompt's LLM keys/values
    served_model_name: str = "MiniCPM-o-2_6"  # what /v1/models shows (never a local path)
    keep_traces: bool = False  # tests: keep each finished stream's codes (see ``trace``)
    cuda_graphs: bool = True  # replay the TTS audio step and the decode as CUDA graphs
    profile_phases: bool = False  # benchmarks: time each phase of the step (adds GPU syncs)
    llm_lookahead_pieces: int = 2  # chat: decode ahead of the TTS by at most this many pieces
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
    overlap_llm_step: bool = False
    steps_per_sync: int = 5  # audio frames per engine step, chained on the device (one host sync);
    # a divisor of chunk_frames keeps every generate call aligned to engine steps
    # decode-step attention of the TTS: sdpa | matmul | flex (layers.py). flex reads only the
    # key blocks each row sees (1.3-1.7x faster audio frames at 128-512 streams on an H100) but
    # compiles each captured batch shape at start (10-19 s each); the chat LLM keeps sdpa
    one_query_attention: str = "sdpa"
    # DVAE + Vocos weights and activations: float32 (upstream's output to 1e-6) or bfloat16
    # (2.3-2.8x faster on an H100; its error: docs/benchmarks/README.md, "DVAE + Vocos in bf16");
    # the inverse STFT runs in float32 either way
    decode_dtype: str = "float32"
    fuse_projections: bool = True  # q/k/v and gate/up as one matmul each (unquantized layers)
    admission_interval_steps: int = 1  # while streams run, admit every N engine steps
    # padded prompt tokens (prompts x the longest) admitted and prefilled per engine step, as
    # vLLM's max_num_batched_tokens: a burst of short prompts is one pass (every pass reads all
    # the LLM's weights), long ones spread over steps, a prompt over the budget runs alone
    prefill_tokens: int = 4096
    # prompts admitted and prefilled per engine step, at most: the admission prefill's CUDA
    # graphs are captured for batches up to it; a larger admission ran eagerly, and such steps
    # took 0.2-1.3 s at 256-320 read streams on an H100 (docs/benchmarks/README.md)
    prefill_prompts: int = 8
    quantization: str = "none"  # LLM linears: none | int8 | int4 | int4-tinygemm (quantization.py)
    gpu_memory_gb: float | None = None  # cap this engine's CUDA allocations (1e9 bytes), as a
    # smaller GPU would: the A10G profile's 22 leaves an A10G's CUDA context room
    fault_injection: dict | None = None  # tests only: fail/crash markers (see engines/faults.py)
    benchmark: dict | None = None  # benchmarks only: random weights, fixed lengths (benchmark_mode.py)

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        if self.one_query_attention not in ONE_QUERY_KERNELS:
            raise ValueError(f"one_query_attention must be one of {ONE_QUERY_KERNELS}")
        if self.decode_dtype not in DECODE_DTYPES:
            raise ValueError(f"decode_dtype must be one of {sorted(DECODE_DTYPES)}")
        if self.steps_per_sync < 1:
            raise ValueError("steps_per_sync must be at least 1")
        if not isinstance(self.voices, bool):
            raise ValueError("voices must be true or false (voice cloning on or off)")
        if self.prefill_tokens < 1:
            raise ValueError("prefill_tokens must be at least 1")
        if self.prefill_prompts < 1:
            raise ValueError("prefill_prompts must be at least 1")
        if self.max_voices < 1:
            raise ValueError("max_voices must be at least 1")
        if self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0:
            raise ValueError("gpu_memory_gb must be a positive number of gigabytes")
        if not self.text_break_wait_s >= 0:
            raise ValueError("text_break_wait_s must be 0 or more seconds")

    @classmethod
    def from_raw(cls, raw: dict[str, object]) -> "EngineOptions":
        """Options from a plain mapping (serve_config.yaml); unknown keys are an error."""
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(unknown)}")
        return cls(**raw)  # type: ignore[arg-type]

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return {"bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32}[self.dtype]


def clones_voices(model, options: EngineOptions) -> bool:
    """Voice cloning is on: ``voices`` asks for it and the model has its audio encoder."""
    return options.voices and getattr(model, "clip_encoder", None) is not None
