"""Weight-only quantization of the LLM's linear layers through torchao (the ``quant`` extra).

``int4``: torchao's ``Int4WeightOnlyConfig(group_size=128)`` in the ``tile_packed_to_4d``
layout, whose matmul is PyTorch's own tinygemm kernel (``_weight_int4pack_mm``, CUDA, bf16
activations); the default ``plain`` layout needs the separate mslk kernels. CPU has no kernel
for that layout, so there int4 keeps the (dequantized) weights in the compute dtype.
``int8``: ``Int8WeightOnlyConfig`` (per output row), on any device.

What is quantized: every ``nn.Linear`` of the decoder layers (q/k/v/o, gate/up/down). Not the
embeddings, nor ``lm_head``: GPTQ checkpoints made with AutoGPTQ normally keep it unquantized
too, its error goes straight into every chat token's logits, and in bf16 it costs 1.1 GB, which
an A10G can afford. The TTS, DVAE and Vocos are never touched.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("none", "int8", "int4")
INT4_GROUP_SIZE = 128


class QuantizationUnavailableError(RuntimeError):
    """The asked quantization needs a library that is not installed."""


def _torchao_config(mode: str):
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    except ImportError as error:
        raise QuantizationUnavailableError(
            f"quantization {mode!r} needs torchao: pip install 'minicpmo-serve[quant]' "
            f"(or pip install torchao); set quantization: none to run without it") from error
    if mode == "int4":
        import torchao

        if tuple(int(x) for x in torchao.__version__.split(".")[:2]) < (0, 18):
            logger.warning("torchao %s clamps int4 scales at bf16 eps (0.0078): weight groups "
                           "with a range under 0.12 lose precision; use torchao >= 0.18",
                           torchao.__version__)
        return Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE,
                                    int4_packing_format="tile_packed_to_4d",
                                    set_inductor_config=False)
    return Int8WeightOnlyConfig(set_inductor_config=False)


def check_mode(mode: str) -> str:
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    return mode


def effective_mode(mode: str, device: torch.device) -> str:
    """What ``mode`` becomes on ``device``: int4 runs dequantized where it has no kernel."""
    check_mode(mode)
    if mode == "int4" and torch.device(device).type != "cuda":
        return "none"
    return mode


def quantize_linears(module: nn.Module, mode: str) -> int:
    """Quantize every ``nn.Linear`` inside ``module`` in place; returns how many.

    ``mode`` is an effective mode (see :func:`effective_mode`); ``none`` does nothing and
    needs no torchao. int4 weights are quantized from bf16 (tinygemm's activation dtype).
    """
    check_mode(mode)
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if mode == "none" or not linears:
        return 0
    config = _torchao_config(mode)
    from torchao.quantization import quantize_

    if mode == "int4":
        for linear in linears:
            if linear.weight.dtype != torch.bfloat16:
                linear.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16),
                                             requires_grad=False)
    quantize_(module, config)
    return len(linears)


def quantize_llm(llm: nn.Module, mode: str) -> str:
    """Quantize the decoder layers' linears of a loaded ``QwenLM``; returns the effective mode.

    The loader quantizes layer by layer while it reads (so a bf16 copy of the whole LLM never
    sits on the device); this is for a model built otherwise (benchmarks' random weights).
    """
    device = next(llm.parameters()).device
    effective = effective_mode(mode, device)
    if effective != mode:
        logger.warning("quantization %s has no kernel on %s: running dequantized weights", mode,
                       device.type)
    elif mode != "none":
        _torchao_config(mode)  # fail before touching any layer when torchao is missing
    for layer in llm.model.layers:
        quantize_linears(layer, effective)
    return effective


def require_backend(mode: str, device: torch.device) -> None:
    """Raise :class:`QuantizationUnavailableError` now if ``mode`` on ``device`` needs torchao."""
    effective = effective_mode(mode, device)
    if effective != "none":
        _torchao_config(effective)
