"""Read the GPTQ layout of the official int4 checkpoint (``openbmb/MiniCPM-o-2_6-int4``).

Each quantized linear ``<name>`` is stored as AutoGPTQ writes it:

- ``<name>.qweight`` int32 [in / 8, out]: 8 four-bit codes per word along the input dimension,
  input ``8 r + j`` in bits ``4 j .. 4 j + 3`` of row ``r`` (lowest nibble first);
- ``<name>.qzeros`` int32 [groups, out / 8]: zero points packed the same way along the output;
  the "gptq" (v1) format stores ``zero - 1``, "gptq_v2" the zero itself;
- ``<name>.scales`` float16 [groups, out];
- ``<name>.g_idx`` int32 [in]: the group of every input (a permutation of groups with
  ``desc_act``; ``k // group_size`` without), optional;
- ``<name>.bias`` float16 [out] where the linear has one.

The weight is ``W[o, k] = scales[g_idx[k], o] * (q[k, o] - zero[g_idx[k], o])``. The loader turns
each such linear back into a dense weight in the compute dtype (one linear at a time, on the
target device), or, for the int4 kernel, hands its codes, scales and zeros over as they are
(:func:`gptq_int4_weight`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .quantization import Int4Weight

GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class GPTQConfig:
    """``quantize_config.json`` (or ``config.json``'s ``quantization_config``) of a GPTQ checkpoint."""

    bits: int
    group_size: int
    desc_act: bool = False
    sym: bool = True
    zero_offset: int = 1  # "gptq" (v1) stores zero - 1; "gptq_v2" stores the zero

    @classmethod
    def from_dict(cls, raw: dict) -> "GPTQConfig":
        bits = int(raw["bits"])
        if bits != 4:
            raise ValueError(f"GPTQ checkpoint with {bits}-bit weights: only 4-bit is supported")
        fmt = str(raw.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"unsupported GPTQ checkpoint_format {fmt!r}")
        return cls(bits=bits, group_size=int(raw.get("group_size", -1)),
                   desc_act=bool(raw.get("desc_act", False)), sym=bool(raw.get("sym", True)),
                   zero_offset=1 if fmt == "gptq" else 0)

    @classmethod
    def from_checkpoint(cls, path: Path) -> "GPTQConfig | None":
        """The checkpoint's GPTQ settings, or None when it is not GPTQ-quantized."""
        quantize_config = path / "quantize_config.json"
        if quantize_config.exists():
            return cls.from_dict(json.loads(quantize_config.read_text()))
        config = path / "config.json"
        raw = json.loads(config.read_text()).get("quantization_config") if config.exists() else None
        if raw and str(raw.get("quant_method", "")).lower() == "gptq":
            return cls.from_dict(raw)
        return None


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Unpack int32 words holding 8 four-bit codes (lowest nibble first) along ``dim``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1)
    codes = (moved.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift; the mask drops sign bits
    return codes.flatten(-2).movedim(-1, dim)


def _unpack_gptq_linear(parts: dict[str, torch.Tensor], config: GPTQConfig
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """codes [in, out], zeros and scales [groups, out], g_idx [in] (long) and the group size."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    codes = unpack_int4(qweight, 0)  # [in, out]
    in_features, out_features = codes.shape
    zeros = unpack_int4(qzeros, 1)[:, :out_features] + config.zero_offset  # [groups, out]
    if scales.shape != zeros.shape:
        raise ValueError(f"GPTQ scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} differ")
    group_size = config.group_size if config.group_size > 0 else in_features
    g_idx = parts.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_features, device=codes.device) // group_size
    g_idx = g_idx.long()
    if g_idx.shape != (in_features,) or int(g_idx.max()) >= scales.shape[0]:
        raise ValueError("GPTQ g_idx does not match qweight and scales")
    return codes, zeros, scales, g_idx, group_size


def dequantize_gptq_linear(parts: dict[str, torch.Tensor], config: GPTQConfig,
                           dtype: torch.dtype) -> torch.Tensor:
    """The dense ``nn.Linear`` weight [out, in] of one GPTQ linear, in ``dtype``.

    ``parts`` holds ``qweight``, ``qzeros``, ``scales`` and optionally ``g_idx``, all on the
    device the weight should land on. The arithmetic is float32, rounded to ``dtype`` once.
    """
    codes, zeros, scales, g_idx, _ = _unpack_gptq_linear(parts, config)
    weight = scales.float()[g_idx] * (codes - zeros[g_idx]).float()
    return weight.t().contiguous().to(dtype)


def gptq_int4_weight(parts: dict[str, torch.Tensor], config: GPTQConfig) -> Int4Weight | None:
    """The GPTQ linear's codes, scales and zeros as an :class:`Int4Weight` (no dense weight is
    made), or None when its groups are not consecutive runs of inputs (act-order ``g_idx``),
    which the int4 kernel cannot express."""
    codes, zeros, scales, g_idx, group_size = _unpack_gptq_linear(parts, config)
    in_features = codes.shape[0]
    consecutive = torch.arange(in_features, device=g_idx.device) // group_size
    if in_features % group_size or not torch.equal(g_idx, consecutive):
        return None
    return Int4Weight(codes.t().to(torch.uint8).contiguous(), scales.t().float().contiguous(),
                      zeros.t().float().contiguous(), group_size)
