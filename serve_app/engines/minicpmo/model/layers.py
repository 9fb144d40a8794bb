"""Decoder layers that read and write a slot-based KV cache.

The math (gated MLP, rotary embedding) is transformers' own Llama/Qwen2 code, RMSNorm is torch's
fused ``rms_norm`` with transformers' parameters (one kernel instead of seven); what is
ours is the attention over a preallocated cache of ``slots x positions`` with per-row write
positions and masks, so admission and completion never reallocate and decode steps keep static
shapes. Module attribute names mirror the checkpoint keys (``self_attn.q_proj`` ...), so loading
is a plain ``load_state_dict``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (  # the math is transformers' own
    LlamaMLP,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    rotate_half,
)

from .flex_attention import flex_one_query_attention, visible_blocks
from .kv_cache import LayerKV, SlotKVCache  # noqa: F401  (SlotKVCache: imported from here too)
from .names import ONE_QUERY_KERNELS
from .range_attention import reference_two_range_attention, rope_write_two_range_attention


@dataclass(frozen=True)
class DecoderShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class StepInputs:
    """Per-row addressing of one forward pass over the cache.

    ``rows``: slot index of each row [B]; ``positions``: rotary positions [B, S];
    ``write_positions``: where each token's K/V goes [B, S] (scratch for padding);
    ``attend``: boolean mask [B, 1, S, T] over the first T cache positions (True = visible;
    a T shorter than the cache makes attention read only those positions);
    ``contiguous``: rows are exactly ``0..B-1``, so the cache is sliced instead of gathered;
    ``block_mask``: FlexAttention's block mask of ``attend`` (:func:`visible_blocks`), built by
    the first layer that attends with flex and read by the others;
    ``ranges``: the keys ``attend`` marks as two ranges per row, [B, 3] (a_end, b_start, b_end;
    :mod:`.range_attention`), where a one-query step can give them.
    """

    rows: torch.Tensor
    positions: torch.Tensor
    write_positions: torch.Tensor
    attend: torch.Tensor
    contiguous: bool = False
    block_mask: object | None = None
    ranges: torch.Tensor | None = None


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, head_dim] as transformers' default rotary embedding computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class SlotAttention(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, shape.num_heads * shape.head_dim, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(shape.hidden_size, shape.num_kv_heads * shape.head_dim, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(shape.hidden_size, shape.num_kv_heads * shape.head_dim, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.num_heads * shape.head_dim, shape.hidden_size, bias=False)
        self.one_query_kernel = "sdpa"  # see set_one_query_attention
        # q, k and v as one matmul (hidden -> [q | k | v]): see fuse_projections, or an int4
        # kernel over the fused weight (quantization.py)
        self.fused_qkv: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _fused_qkv_heads(self, hidden: torch.Tensor) -> torch.Tensor:
        """The fused projection as [B, S, H + 2 Hkv, D]: query heads, key heads, value heads."""
        batch, seq, _ = hidden.shape
        return self.fused_qkv(hidden).view(batch, seq, self.num_heads + 2 * self.num_kv_heads,
                                           self.head_dim)

    def _projections(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, S, H, D], k and v [B, S, Hkv, D], before the rotary embedding."""
        batch, seq, _ = hidden.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused_qkv is not None:
            qkv = self._fused_qkv_heads(hidden)
            return (qkv[:, :, :heads], qkv[:, :, heads:heads + kv_heads],
                    qkv[:, :, heads + kv_heads:])
        return (self.q_proj(hidden).view(batch, seq, heads, dim),
                self.k_proj(hidden).view(batch, seq, kv_heads, dim),
                self.v_proj(hidden).view(batch, seq, kv_heads, dim))

    def fuse_projections(self) -> None:
        """One matmul for q, k and v: their weights become views of one concatenated tensor
        (the checkpoint names and the memory stay as they are)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if self.fused_qkv is not None or not _plain_linears(projections):
            return
        weight, bias = _concatenate_linears(projections)
        self.fused_qkv = functools.partial(F.linear, weight=weight, bias=bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: LayerKV, step: StepInputs) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        by_ranges = (seq == 1 and self.one_query_kernel == "visible_ranges"
                     and step.ranges is not None)
        if by_ranges and hidden.is_cuda:  # rotary, cache write and attention in one kernel
            q, k, v = self._projections(hidden)
            out = rope_write_two_range_attention(
                q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], kv.keys, kv.values, step.rows,
                step.write_positions[:, 0], step.ranges, kv.key_scales, kv.value_scales)
            return self.o_proj(out.reshape(batch, seq, -1))
        if self.fused_qkv is not None:
            qkv = self._fused_qkv_heads(hidden)
            qk = qkv[:, :, :heads + kv_heads].transpose(1, 2)
            v = qkv[:, :, heads + kv_heads:].transpose(1, 2)
            # transformers' rotary formula, applied to queries and keys in one pass
            qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k, v = (t.transpose(1, 2) for t in self._projections(hidden))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        kv.write(step.rows[:, None], step.write_positions, k.transpose(1, 2), v.transpose(1, 2))
        if by_ranges:
            row_keys, row_values = kv.read(step.rows)
            out = reference_two_range_attention(q, row_keys, row_values, step.ranges)
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        rows = slice(0, batch) if step.contiguous else step.rows
        row_keys, row_values = kv.read(rows, step.attend.shape[-1])
        if seq == 1 and self.one_query_kernel == "matmul":
            out = one_query_attention(q, row_keys, row_values, step.attend)
        elif seq == 1 and self.one_query_kernel == "flex":
            if step.block_mask is None:  # once per step: every layer sees the same keys
                step.block_mask = visible_blocks(step.attend)
            out = flex_one_query_attention(q, row_keys, row_values, step.attend, step.block_mask)
        else:
            out = F.scaled_dot_product_attention(q, row_keys, row_values, attn_mask=step.attend,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def set_one_query_attention(model: nn.Module, kernel: str) -> None:
    """Choose how the decoders in ``model`` attend for one query per row (decode steps):
    ``sdpa`` (torch's fused kernels), ``matmul`` (:func:`one_query_attention`), ``flex``
    (:func:`flex_one_query_attention`: only the key blocks a row can see are read) or
    ``visible_ranges`` (:mod:`.range_attention`: only the keys a row sees, where the step gives
    them as ranges, in one kernel with the rotary embedding and the cache write on CUDA; SDPA
    where the step gives no ranges)."""
    if kernel not in ONE_QUERY_KERNELS:
        raise ValueError(f"one-query attention must be one of {ONE_QUERY_KERNELS}, not {kernel!r}")
    for module in model.modules():
        if isinstance(module, SlotAttention):
            module.one_query_kernel = kernel


def one_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        attend: torch.Tensor) -> torch.Tensor:
    """Attention of one query per row (q [B, H, 1, D]; keys/values [B, Hkv, T, D]; attend
    [B, 1, 1, T]) as two batched matmuls with a float32 softmax; query heads that share a
    key/value head are stacked as rows of one matmul."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * dim ** -0.5
    scores = scores.masked_fill(~attend, float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values).reshape(batch, heads, 1, dim)


def _plain_linears(linears: tuple[nn.Module, ...]) -> bool:
    """Plain float ``nn.Linear`` layers (not quantized tensor subclasses)."""
    return all(type(m) is nn.Linear and type(m.weight.data) is torch.Tensor for m in linears)


def _concatenate_linears(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` along the output dimension and make
    each layer's parameters views of the result; returns the concatenated weight and bias."""
    weight = torch.cat([m.weight.data for m in linears])
    bias = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    start = 0
    for m in linears:
        end = start + m.out_features
        m.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


class GatedMLP(LlamaMLP):
    """transformers' Llama MLP; after :meth:`fuse_projections` gate and up are one matmul."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        # gate and up as one matmul (x -> [gate | up]): see fuse_projections, or an int4 kernel
        self.fused_gate_up: Callable[[torch.Tensor], torch.Tensor] | None = None

    def fuse_projections(self) -> None:
        if (self.fused_gate_up is None and _plain_linears((self.gate_proj, self.up_proj))
                and self.gate_proj.bias is None):
            weight, _ = _concatenate_linears((self.gate_proj, self.up_proj))
            self.fused_gate_up = functools.partial(F.linear, weight=weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is None:
            return super().forward(x)
        gate, up = self.fused_gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse_projections(model: nn.Module) -> None:
    """Fewer, larger matmuls in every decoder layer of ``model`` (q/k/v, gate/up); layers whose
    weights are quantized stay as they are."""
    for module in model.modules():
        if isinstance(module, (SlotAttention, GatedMLP)):
            module.fuse_projections()


class RMSNorm(LlamaRMSNorm):
    """transformers' Llama RMSNorm (same parameters and epsilon) computed by torch's fused
    ``rms_norm``: in float32 it gives the same numbers; in bfloat16 it rounds once at the end
    instead of once before the weight."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden, self.weight.shape, self.weight, self.variance_epsilon)


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, mlp_config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = SlotAttention(shape)
        self.mlp = GatedMLP(mlp_config)
        self.input_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: LayerKV, step: StepInputs) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv, step)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class SlotDecoder(nn.Module):
    """A Llama/Qwen2 decoder stack (``layers``, ``norm``) over a :class:`SlotKVCache`."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        mlp_config = LlamaConfig(hidden_size=shape.hidden_size,
                                 intermediate_size=shape.intermediate_size,
                                 hidden_act="silu", mlp_bias=False)
        self.layers = nn.ModuleList([DecoderLayer(shape, mlp_config) for _ in range(shape.num_layers)])
        self.norm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cache: SlotKVCache, step: StepInputs) -> torch.Tensor:
        cos, sin = rotary_cos_sin(step.positions, self.shape.head_dim, self.shape.rope_theta,
                                  hidden.dtype)
        for layer, kv in zip(self.layers, cache.layers):
            hidden = layer(hidden, cos, sin, kv, step)
        return self.norm(hidden)


def causal_attend(positions: torch.Tensor, valid: torch.Tensor, total_positions: int) -> torch.Tensor:
    """Plain causal visibility [B, 1, S, T]: a query at position p sees keys ``0..p``.

    ``valid`` [B, S] marks real tokens; padded queries see key 0 only (their output is unused,
    but a row with no visible key would give NaN).
    """
    keys = torch.arange(total_positions, device=positions.device)
    visible = keys[None, None, :] <= positions[:, :, None]
    visible = torch.where(valid[:, :, None], visible, keys[None, None, :] == 0)
    return visible[:, None]
