"""Weight-only quantization of the LLM's linear layers (the ``quant`` extra).

``int4``: 4-bit weights in groups of 128 inputs, W = scale * (code - zero), multiplied by
GemLite's Triton kernels (``gemlite``: GEMV for 1-4 rows, split-K GEMM up to 64, GEMM above;
Ampere and Hopper alike). q/k/v and gate/up are quantized as one fused weight each, so a
decoder layer runs four int4 matmuls, whose shapes GemLite ships tuned configurations for
(Qwen2-7B's). An official GPTQ checkpoint's codes, scales and zeros go straight into the kernel's
layout (:func:`gemlite_linear`), with no dense round trip.
On CPU ``int4`` runs the same weights through PyTorch's own CPU int4 matmul
(``_weight_int4pack_mm_for_cpu``, :class:`CpuInt4Linear`), so the whole int4 path, GPTQ codes
included, runs in the CPU tests too.
``int4-tinygemm``: torchao's ``Int4WeightOnlyConfig(group_size=128)`` in the
``tile_packed_to_4d`` layout, PyTorch's own tinygemm kernel (``_weight_int4pack_mm``); fast for
one row, several times slower than bf16 for the batched prefill and decode (kept to compare).
It has no CPU kernel here, so on CPU it keeps the (dequantized) weights in the compute dtype.
``int8``: torchao's ``Int8WeightOnlyConfig`` (per output row), on any device.

What is quantized: every ``nn.Linear`` of the decoder layers (q/k/v/o, gate/up/down). Not the
embeddings, nor ``lm_head``: GPTQ checkpoints made with AutoGPTQ normally keep it unquantized
too, its error goes straight into every chat token's logits, and in bf16 it costs 1.1 GB, which
an A10G can afford. The TTS, DVAE and Vocos are never touched.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .names import QUANTIZATION_MODES, check_quantization  # noqa: F401 (modes: bench_engine)

logger = logging.getLogger(__name__)

INT4_GROUP_SIZE = 128


class QuantizationUnavailableError(RuntimeError):
    """The asked quantization needs a library that is not installed."""


def _unavailable(mode: str, library: str, extra: str) -> QuantizationUnavailableError:
    return QuantizationUnavailableError(
        f"quantization {mode!r} needs {library}: pip install 'minicpmo-serve[{extra}]' "
        f"(or pip install {library}); set quantization: none to run without it")


def _torchao_config(mode: str):
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    except ImportError as error:
        raise _unavailable(mode, "torchao", "quant") from error
    if mode == "int4-tinygemm":
        return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE,
                                    int4_packing_format="tile_packed_to_4d",
                                    set_inductor_config=False)
    return Int8WeightOnlyConfig(set_inductor_config=False)


# GPUs GemLite ships no tuned kernel configurations for, and the GPU of the same chip whose
# configurations they take (otherwise every new shape and row count is autotuned on first use,
# which can land in the middle of serving). The A10G and the A40 are both GA102 (sm_86).
SAME_CHIP_CONFIGS = {"a10g": "a40"}


def _gemlite():
    """GemLite's linear layer class and dtype enum (imported only on CUDA: importing it looks
    up the GPU to pick its tuned configurations)."""
    try:
        from gemlite.core import DType, GemLiteLinearTriton
    except ImportError as error:
        raise _unavailable("int4", "gemlite", "gpu") from error
    _load_same_chip_configs(GemLiteLinearTriton)
    return GemLiteLinearTriton, DType


@functools.cache
def _load_same_chip_configs(linear_class) -> None:
    import gemlite

    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    for gpu, same_chip in SAME_CHIP_CONFIGS.items():
        if gpu in name:
            configs = Path(gemlite.__file__).parent / "configs" / f"{same_chip}.json"
            if linear_class.load_config(str(configs), print_error=False):
                logger.info("GemLite: %s kernel configurations for the %s", same_chip, gpu)


def effective_mode(mode: str, device: torch.device) -> str:
    """What ``mode`` becomes on ``device``: int4 runs dequantized where it has no kernel
    (``int4`` has one on CUDA and CPU, ``int4-tinygemm`` on CUDA only)."""
    check_quantization(mode)
    kind = torch.device(device).type
    if mode == "int4" and kind not in ("cuda", "cpu") or mode == "int4-tinygemm" and kind != "cuda":
        return "none"
    return mode


def resolve_mode(mode: str, device: torch.device) -> str:
    """The effective mode of ``mode`` on ``device`` (:func:`effective_mode`, with a warning when
    int4 falls back to dequantized weights), once its library is known to be installed
    (:func:`require_backend`): call it before loading or building anything."""
    effective = effective_mode(mode, device)
    if effective != mode:
        logger.warning("quantization %s has no kernel on %s: running dequantized weights", mode,
                       torch.device(device).type)
    require_backend(effective, device)
    return effective


def require_backend(mode: str, device: torch.device) -> None:
    """Raise :class:`QuantizationUnavailableError` now if ``mode`` on ``device`` needs a library
    that is missing."""
    effective = effective_mode(mode, device)
    if effective == "int4":
        if torch.device(device).type == "cuda":
            _gemlite()
    elif effective != "none":
        _torchao_config(effective)


@dataclass
class Int4Weight:
    """A linear's weight as 4-bit codes in groups along the inputs:
    ``W[o, k] = scales[o, g] * (codes[o, k] - zeros[o, g])`` with ``g = k // group_size``.

    ``codes`` uint8 [out, in] (0..15); ``scales`` and ``zeros`` float32 [out, in / group_size]
    (a GPTQ zero is an integer, a quantized float weight's need not be).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> "Int4Weight":
        """Round-to-nearest with each group's minimum and maximum as codes 0 and 15."""
        out_features, in_features = weight.shape
        if in_features % group_size:
            raise ValueError(f"{in_features} inputs are not a multiple of groups of {group_size}")
        grouped = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        zeros = -low / scales
        codes = torch.round(grouped / scales[..., None] + zeros[..., None]).clamp_(0, 15)
        return cls(codes.to(torch.uint8).reshape(out_features, in_features), scales, zeros,
                   group_size)

    @classmethod
    def concatenate(cls, weights: list["Int4Weight"]) -> "Int4Weight":
        """One weight whose outputs are ``weights``' outputs in turn (a fused projection)."""
        if len({w.group_size for w in weights}) != 1:
            raise ValueError("fused int4 weights need one group size")
        return cls(torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]),
                   torch.cat([w.zeros for w in weights]), weights[0].group_size)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        expand = lambda t: t.repeat_interleave(self.group_size, dim=1)  # noqa: E731
        return (expand(self.scales) * (self.codes.float() - expand(self.zeros))).to(dtype)


def int4_group_size(in_features: int) -> int:
    """Groups of :data:`INT4_GROUP_SIZE` inputs, or of 64 or 32 for a linear too narrow for
    them (the tests' tiny model); both kernels take 32, 64 and 128."""
    for size in (INT4_GROUP_SIZE, 64, 32):
        if in_features % size == 0:
            return size
    raise ValueError(f"int4 needs a multiple of 32 inputs, not {in_features}")


class CpuInt4Linear(nn.Module):
    """An :class:`Int4Weight` multiplied by PyTorch's own CPU int4 kernel
    (``_weight_int4pack_mm_for_cpu``: tinygemm's layout, ``W = (q - 8) * scale + zero``, so the
    zero is stored as ``scale * (8 - zero)``); what ``int4`` runs on CPU."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        scales = weight.scales.t()  # [groups, out]
        offsets = scales * (8 - weight.zeros.t())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.codes.to(torch.int32).contiguous(), 1))
        self.register_buffer("scales_and_zeros",
                             torch.stack([scales, offsets], dim=-1).to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).contiguous(), self.packed, self.group_size,
            self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def int4_linear(weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """The int4 matmul for ``weight`` on its device: GemLite on CUDA, PyTorch's kernel on CPU."""
    if weight.codes.device.type == "cuda":
        return gemlite_linear(weight, bias, dtype)
    return CpuInt4Linear(weight, bias, dtype)


def is_int4_linear(module: nn.Module) -> bool:
    return isinstance(module, (CpuInt4Linear, BucketedRowsLinear))


class BucketedRowsLinear(nn.Module):
    """A linear kernel that is only ever called with the row counts ``bucket_rows`` gives:
    other counts are padded with zero rows and the output cut back.

    GemLite's Triton kernels are compiled per row-count bucket and also per what the row count
    divides (Triton specializes an integer argument on ``% 16``, GemLite on ``M % BLOCK_M``):
    row counts the start-up warm-up never ran would compile in the middle of serving (the
    likely reason, not yet confirmed, why a burst of 64 chat prompts, a 1071-row prefill, waited
    795 ms at p99 for its first audio on an H100). Running every call at a warmed count keeps
    every compile at start."""

    def __init__(self, kernel: nn.Module, in_features: int, out_features: int,
                 bucket_rows) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_features, self.out_features = in_features, out_features
        self.bucket_rows = bucket_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        padded = self.bucket_rows(rows)
        if padded != rows:
            flat = F.pad(flat, (0, 0, 0, padded - rows))
        out = self.kernel(flat)[:rows]
        return out.reshape(*x.shape[:-1], self.out_features)


GEMLITE_LARGE_ROWS = 256  # above GemLite's largest bucket rows round up to a multiple of this


def gemlite_rows(rows: int) -> int:
    """The row count a GemLite call of ``rows`` rows runs at: its tuning bucket (the next of
    GemLite's listed counts, up to its largest), above that the next multiple of
    :data:`GEMLITE_LARGE_ROWS` (divisible by every block height GemLite uses)."""
    from gemlite.triton_kernels.utils import M_MAXVAL, get_closest_m

    if rows <= M_MAXVAL:
        return get_closest_m(rows)
    return -(-rows // GEMLITE_LARGE_ROWS) * GEMLITE_LARGE_ROWS


def gemlite_linear(weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """A GemLite int4 linear (a module taking [..., in] activations in ``dtype``) for ``weight``,
    on ``weight``'s device. The kernel computes ``(code - zero) * scale`` with scales and zeros
    in ``dtype``."""
    linear_class, gemlite_dtype = _gemlite()
    kind = {torch.bfloat16: gemlite_dtype.BF16, torch.float16: gemlite_dtype.FP16}.get(dtype)
    if kind is None:
        raise ValueError(f"int4 needs bfloat16 or float16 activations, not {dtype}")
    out_features, in_features = weight.shape
    linear = linear_class(4, group_size=weight.group_size, in_features=in_features,
                          out_features=out_features, input_dtype=kind, output_dtype=kind)
    linear.pack(weight.codes.contiguous(), weight.scales.to(dtype).contiguous(),
                weight.zeros.to(dtype).contiguous(),
                bias=None if bias is None else bias.detach().to(dtype), fma_mode=False)
    return BucketedRowsLinear(linear, in_features, out_features, gemlite_rows)


def warm_up_int4_kernels(module: nn.Module, max_rows: int = 4096) -> int:
    """Run each int4 matmul shape in ``module`` once at every row count :func:`gemlite_rows`
    can give (GemLite's buckets up to ``max_rows`` and one above), so Triton compiles them
    (and autotunes those it has no tuned configuration for) at start, not in the middle of
    serving, where every stream would wait for it. Returns how many calls that took (0
    without int4 layers)."""
    layers = [m for m in module.modules()
              if isinstance(m, BucketedRowsLinear) and m.bucket_rows is gemlite_rows]
    if not layers:
        return 0  # no GemLite layers (bf16, torchao, or the CPU int4 kernel)
    shapes: dict[tuple[int, int], BucketedRowsLinear] = {}
    for layer in layers:
        shapes.setdefault((layer.in_features, layer.out_features), layer)
    # every count a call can run at (gemlite_rows): the buckets, and one count above them
    buckets = sorted({gemlite_rows(rows) for rows in range(1, max_rows + 1)}
                     | {gemlite_rows(max_rows + 1)})
    calls = 0
    with torch.inference_mode():
        for linear in shapes.values():
            kernel = linear.kernel
            for rows in buckets:
                kernel(torch.randn(rows, linear.in_features, dtype=kernel.compute_dtype,
                                   device=kernel.W_q.device))
                calls += 1
    torch.cuda.synchronize()
    return calls


def _int4_of(linear: nn.Linear, name: str, given: dict[str, Int4Weight] | None) -> Int4Weight:
    if given is not None and name in given:
        return given.pop(name)
    return Int4Weight.quantize(linear.weight, int4_group_size(linear.in_features))


def _bias_of(linears: list[nn.Linear]) -> torch.Tensor | None:
    biases = [linear.bias for linear in linears]
    present = [b for b in biases if b is not None]
    if not present:
        return None
    return torch.cat([b.detach() if b is not None else present[0].new_zeros(linear.out_features)
                      for b, linear in zip(biases, linears)])


def quantize_layer_int4(layer: nn.Module, dtype: torch.dtype,
                        given: dict[str, Int4Weight] | None = None) -> int:
    """Replace a decoder layer's linears with int4 matmuls (:func:`int4_linear`): q/k/v fused,
    gate/up fused, o and down alone. ``given`` maps linear names (``self_attn.q_proj``) to int4
    weights read from a checkpoint; the rest are quantized from their float weights. Returns
    the number of linears replaced."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = (("self_attn", attn, ("q_proj", "k_proj", "v_proj"), "fused_qkv"),
              ("self_attn", attn, ("o_proj",), "o_proj"),
              ("mlp", mlp, ("gate_proj", "up_proj"), "fused_gate_up"),
              ("mlp", mlp, ("down_proj",), "down_proj"))
    for prefix, owner, names, target in groups:
        linears = [getattr(owner, name) for name in names]
        weight = Int4Weight.concatenate([_int4_of(linear, f"{prefix}.{name}", given)
                                         for linear, name in zip(linears, names)])
        module = int4_linear(weight, _bias_of(linears), dtype)
        for name in names:
            setattr(owner, name, None)
        setattr(owner, target, module)
    return 7


def quantize_linears(module: nn.Module, mode: str) -> int:
    """Quantize every ``nn.Linear`` inside ``module`` in place with torchao; returns how many.

    ``mode`` is an effective torchao mode (``int8``, ``int4-tinygemm``) or ``none``, which does
    nothing and needs no torchao. tinygemm's weights are quantized from bf16 (its activation
    dtype).
    """
    check_quantization(mode)
    if mode == "int4":
        raise ValueError("int4 quantizes whole decoder layers: use quantize_decoder_layer")
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if mode == "none" or not linears:
        return 0
    config = _torchao_config(mode)
    from torchao.quantization import quantize_

    if mode == "int4-tinygemm":
        for linear in linears:
            if linear.weight.dtype != torch.bfloat16:
                linear.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16),
                                             requires_grad=False)
    quantize_(module, config)
    return len(linears)


def quantize_decoder_layer(layer: nn.Module, mode: str, dtype: torch.dtype,
                           given: dict[str, Int4Weight] | None = None) -> int:
    """Quantize one decoder layer's linears as the effective ``mode`` asks; returns how many."""
    if mode == "int4":
        return quantize_layer_int4(layer, dtype, given)
    if mode != "none":
        # torchao swaps each linear's own weight: a fused matmul over views of the float
        # weights (layers.fuse_projections) would go on reading those, so undo the fusion
        layer.self_attn.fused_qkv = None
        layer.mlp.fused_gate_up = None
    return quantize_linears(layer, mode)


def quantize_llm(llm: nn.Module, mode: str) -> str:
    """Quantize the decoder layers' linears of a loaded ``QwenLM``; returns the effective mode.

    The loader quantizes layer by layer while it reads (so a bf16 copy of the whole LLM never
    sits on the device); this is for a model built otherwise.
    """
    parameter = next(llm.parameters())
    effective = resolve_mode(mode, parameter.device)  # fails before touching any layer
    for layer in llm.model.layers:
        quantize_decoder_layer(layer, effective, parameter.dtype)
    return effective
