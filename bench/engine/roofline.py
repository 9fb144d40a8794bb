"""What each phase of the engine's step asks of the GPU, and how close it came to the limits.

From ``ModelRunner.work`` counts (device calls, rows, tokens, key positions read) and the
model's shapes, each phase of a step gets the bytes it must move and the FLOPs it must do:

- bytes: every weight once per device call (per frame step for audio windows) and the key and
  value positions attention reads; embedding tables are left out (a step reads only its rows);
  activations and cache writes are small beside these and left out too;
- FLOPs: 2 per weight per row (token) for the matmuls, 4 per key position and head dimension
  for attention (QK and PV), and DVAE + Vocos counted by torch's ``FlopCounterMode`` on a piece
  of frames; attention inside a prefill and the prefills' logits are left out (short prompts).

Beside a measured phase time this gives the bandwidth and FLOP rate it reached, the fraction of
the GPU's peak of each, and ``roofline_ms``: the least time the phase could take on this GPU
(bytes / bandwidth or FLOPs / FLOP rate, whichever is longer), so the distance to the limit is
one number (``of_roofline`` = roofline_ms / measured ms).

:func:`project` carries a measured step to another GPU on paper: each phase keeps the
efficiency it reached here (its time scales with its roofline time on the other GPU), and the
host's work (``schedule``) stays as it was. That is a projection, not a measurement: phases
bound by launches and host work, not by the GPU's roofs, scale less than it says.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from serve_app.engines.minicpmo.model.quantization import INT4_GROUP_SIZE, is_int4_linear


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth: float  # bytes/s, HBM/GDDR peak
    bf16_flops: float  # dense bf16 tensor-core FLOP/s


GPUS = {"h100": GPU("H100 SXM", 3.35e12, 989e12), "h200": GPU("H200", 4.8e12, 989e12),
        "a10g": GPU("A10G", 600e9, 125e12)}

# Phases of the engine step (step/phases.py:PhaseClock.lap) and what each asks of the device; "schedule" is
# host work only.
PHASE_WORK = {"admit_prefill": "LLM prefill of admitted prompts",
              "llm_decode": "batched LLM decode steps (chat text)",
              "tts_prefill": "TTS text and carried-segment prefills",
              "tts_step": "audio windows (TTS decode steps)",
              "decode_emit": "DVAE + Vocos decode of finished pieces"}


def tensor_bytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Bytes of a module's tensors as stored (quantized tensors by their parts), less ``skip``."""
    total = 0
    for name, tensor in module.state_dict().items():
        if name.startswith(skip):
            continue
        inner = [getattr(tensor, part) for part in getattr(tensor, "tensor_data_names", [])]
        total += sum(t.numel() * t.element_size() for t in (inner or [tensor]))
    return total


def kv_bytes_per_position(shape, element_size: int) -> int:
    """Keys and values of one cache position of one row, all layers."""
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * element_size


def matmul_params(shape) -> int:
    """Weights of a decoder stack's linears (q/k/v/o, gate/up/down), all layers."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_layer = shape.hidden_size * (2 * q + 2 * kv) + 3 * shape.hidden_size * shape.intermediate_size
    return per_layer * shape.num_layers


def attention_flops_per_key(shape) -> int:
    """QK and PV for one query against one key position, all heads and layers."""
    return 4 * shape.num_heads * shape.head_dim * shape.num_layers


def decoder_flops_per_frame(decoder, frames: int = 50) -> float:
    """DVAE + Vocos FLOPs per code frame, counted on one piece of ``frames`` random frames."""
    from torch.utils.flop_counter import FlopCounterMode

    codes = torch.randint(0, 626, (frames, 4), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        decoder.decode([codes])
    return counter.get_total_flops() / frames


@dataclass(frozen=True)
class ModelSizes:
    """The byte and FLOP coefficients of a model, per unit of ``ModelRunner.work``."""

    llm_weight_bytes: int  # embeddings left out
    llm_matmul_params: int
    llm_head_params: int
    llm_kv_bytes_per_position: int
    llm_attention_flops_per_key: int
    tts_weight_bytes: int  # text and code embeddings left out
    tts_matmul_params: int
    tts_head_params: int
    tts_kv_bytes_per_position: int
    tts_attention_flops_per_key: int
    decoder_weight_bytes: int
    decoder_flops_per_frame: float
    llm_weights: str = "dense"  # or "int4" (GemLite)

    @classmethod
    def of(cls, model, decoder_flops: float | None = None,
           tts_kv_cache_dtype: str = "auto") -> "ModelSizes":
        element = next(model.tts.parameters()).element_size()
        llm_shape, tts_shape = model.config.llm, model.config.tts_shape()
        decoder = model.decoder if isinstance(model.decoder, torch.nn.Module) else None
        if decoder_flops is None:
            decoder_flops = decoder_flops_per_frame(decoder) if decoder is not None else 0.0
        return cls(
            llm_weight_bytes=tensor_bytes(model.llm, ("model.embed_tokens",)),
            llm_matmul_params=matmul_params(llm_shape),
            llm_head_params=model.llm.lm_head.weight.numel(),
            llm_kv_bytes_per_position=kv_bytes_per_position(llm_shape, element),
            llm_attention_flops_per_key=attention_flops_per_key(llm_shape),
            tts_weight_bytes=tensor_bytes(model.tts, ("emb_text", "emb_code")),
            tts_matmul_params=matmul_params(tts_shape),
            tts_head_params=model.tts.head_code.weight.numel(),
            # fp8: a byte a number and a float32 scale per head_dim numbers (kv_cache.py)
            tts_kv_bytes_per_position=(
                kv_bytes_per_position(tts_shape, element) if tts_kv_cache_dtype == "auto" else
                kv_bytes_per_position(tts_shape, 1) * (tts_shape.head_dim + 4) // tts_shape.head_dim),
            tts_attention_flops_per_key=attention_flops_per_key(tts_shape),
            decoder_weight_bytes=tensor_bytes(decoder) if decoder is not None else 0,
            decoder_flops_per_frame=decoder_flops,
            llm_weights="int4" if any(is_int4_linear(m) for m in model.llm.modules()) else "dense")

    def with_int4_llm(self) -> "ModelSizes":
        """The same model with its LLM decoder linears in int4 (``quantization: int4``): half a
        byte per weight plus a bf16 scale and zero per group of 128."""
        if self.llm_weights == "int4":
            return self
        dense = 2 * self.llm_matmul_params
        int4 = self.llm_matmul_params * (0.5 + 4 / INT4_GROUP_SIZE)
        return replace(self, llm_weight_bytes=int(self.llm_weight_bytes - dense + int4),
                       llm_weights="int4")

    def as_dict(self) -> dict:
        return asdict(self)


def phase_bytes(sizes: ModelSizes, work: dict[str, float]) -> dict[str, float]:
    """Bytes each phase must move for ``work`` (see the module's docstring)."""
    get = lambda key: work.get(key, 0)  # noqa: E731
    return {
        "admit_prefill": (get("llm_prefill_passes") * sizes.llm_weight_bytes
                          + get("llm_prefill_tokens") * sizes.llm_kv_bytes_per_position),
        "llm_decode": (get("llm_steps") * sizes.llm_weight_bytes
                       + get("llm_key_reads") * sizes.llm_kv_bytes_per_position),
        "tts_prefill": ((get("text_prefill_passes") + get("carry_prefills")) * sizes.tts_weight_bytes
                        + get("text_prefill_key_reads") * sizes.tts_kv_bytes_per_position),
        "tts_step": (get("audio_frame_steps") * sizes.tts_weight_bytes
                     + get("audio_key_reads") * sizes.tts_kv_bytes_per_position),
        "decode_emit": get("decode_calls") * sizes.decoder_weight_bytes,
    }


def phase_flops(sizes: ModelSizes, work: dict[str, float]) -> dict[str, float]:
    """FLOPs each phase must do for ``work`` (see the module's docstring)."""
    get = lambda key: work.get(key, 0)  # noqa: E731
    return {
        "admit_prefill": 2 * sizes.llm_matmul_params * get("llm_prefill_tokens"),
        "llm_decode": (2 * (sizes.llm_matmul_params + sizes.llm_head_params) * get("llm_rows")
                       + sizes.llm_attention_flops_per_key * get("llm_key_reads")),
        "tts_prefill": (2 * sizes.tts_matmul_params
                        * (get("text_prefill_tokens") + get("carry_prefill_tokens"))
                        + sizes.tts_attention_flops_per_key * get("text_prefill_key_reads")),
        "tts_step": (2 * (sizes.tts_matmul_params + sizes.tts_head_params) * get("audio_rows")
                     + sizes.tts_attention_flops_per_key * get("audio_key_reads")),
        "decode_emit": sizes.decoder_flops_per_frame * get("decode_frames"),
    }


def roofline_ms(moved: float, flops: float, gpu: GPU) -> float:
    """The least time ``moved`` bytes and ``flops`` FLOPs can take on ``gpu``."""
    return max(moved / gpu.bandwidth, flops / gpu.bf16_flops) * 1000


def roofline(sizes: ModelSizes, work: dict[str, float], steps: int, phase_ms: dict[str, float],
             busy_ms_per_step: float, gpu: GPU | None) -> dict:
    """Per phase: GB and GFLOP per engine step and, with phase times and a known GPU, the
    bandwidth and FLOP rate reached beside its peaks (as gpt-fast prints them), its roofline
    time and the share of it the measured time reached; plus the whole step's."""
    per_step = max(steps, 1)
    moved, flops = phase_bytes(sizes, work), phase_flops(sizes, work)
    phases = {}
    for phase in PHASE_WORK:
        step_bytes, step_flops = moved[phase] / per_step, flops[phase] / per_step
        entry = {"does": PHASE_WORK[phase], "gb_per_step": round(step_bytes / 1e9, 4),
                 "gflop_per_step": round(step_flops / 1e9, 3)}
        ms = phase_ms.get(phase)
        if ms:
            seconds = ms / 1000
            entry.update(ms_per_step=ms, tb_per_s=round(step_bytes / seconds / 1e12, 3),
                         tflop_per_s=round(step_flops / seconds / 1e12, 2))
            if gpu is not None:
                floor = roofline_ms(step_bytes, step_flops, gpu)
                entry.update(peak_fraction=round(step_bytes / seconds / gpu.bandwidth, 3),
                             compute_fraction=round(step_flops / seconds / gpu.bf16_flops, 3),
                             roofline_ms=round(floor, 3), of_roofline=round(floor / ms, 3))
        phases[phase] = entry
    whole = sum(moved.values()) / per_step
    step_rate = whole / (busy_ms_per_step / 1000) if busy_ms_per_step else None
    return {"phases": phases,
            "work_per_step": {k: round(v / per_step, 2) for k, v in sorted(work.items())},
            "gb_per_step": round(whole / 1e9, 4),
            "gflop_per_step": round(sum(flops.values()) / per_step / 1e9, 3),
            "step_tb_per_s": round(step_rate / 1e12, 3) if step_rate else None,
            "step_peak_fraction": (round(step_rate / gpu.bandwidth, 3)
                                   if step_rate and gpu is not None else None),
            "peak_tb_per_s": gpu.bandwidth / 1e12 if gpu is not None else None,
            "peak_bf16_tflop_per_s": gpu.bf16_flops / 1e12 if gpu is not None else None}


def project(work_per_step: dict[str, float], phase_ms: dict[str, float], sizes: ModelSizes,
            gpu: GPU, target_sizes: ModelSizes, target: GPU) -> dict:
    """One measured engine step (its work and phase times on ``gpu`` with ``sizes``) carried to
    ``target`` running ``target_sizes``: each device phase's time is scaled by its roofline
    time there over here, host work is kept. A projection (see the module's docstring)."""
    moved, flops = phase_bytes(sizes, work_per_step), phase_flops(sizes, work_per_step)
    target_moved, target_flops = (phase_bytes(target_sizes, work_per_step),
                                  phase_flops(target_sizes, work_per_step))
    phases = {}
    for phase in PHASE_WORK:
        ms = phase_ms.get(phase, 0.0)
        here = roofline_ms(moved[phase], flops[phase], gpu)
        there = roofline_ms(target_moved[phase], target_flops[phase], target)
        phases[phase] = {"measured_ms": round(ms, 3), "roofline_ms_here": round(here, 3),
                         "roofline_ms_there": round(there, 3),
                         "projected_ms": round(ms * there / here, 3) if here else round(ms, 3)}
    host = {k: v for k, v in phase_ms.items() if k not in PHASE_WORK}
    return {"phases": phases, "host_ms": {k: round(v, 3) for k, v in host.items()},
            "projected_ms_per_step": round(sum(p["projected_ms"] for p in phases.values())
                                           + sum(host.values()), 2)}
