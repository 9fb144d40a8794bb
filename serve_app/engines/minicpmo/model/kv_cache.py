"""The slot caches of keys and values, in the model's dtype or in fp8 (e4m3) with a scale per key.

A :class:`SlotKVCache` holds ``num_slots`` streams of ``max_positions`` each (plus one scratch
position) for every layer; each layer's part is a :class:`LayerKV`, which writes a step's keys
and values into it and reads rows of it back in the model's dtype.

**fp8** (``kv_dtype="fp8_e4m3"``): each key and each value vector (one position of one
key/value head, ``head_dim`` numbers) is stored as e4m3 numbers with one float32 scale, the
vector's largest magnitude over 448 (e4m3's largest finite number), as vLLM's and FlashInfer's
fp8 caches scale per token and head. That halves the bytes a decode step reads and the memory a
slot holds (plus 4 bytes of scale per 64 numbers at the TTS model's head size). The Triton decode
kernel (:mod:`.range_attention`) writes and reads this layout itself; every other path writes
through :meth:`LayerKV.write` and reads through :meth:`LayerKV.read`, which dequantizes. Off by
default: its divergence from the model's dtype is in docs/benchmarks/kv-fp8-numerics.json.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .names import KV_CACHE_DTYPES

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite magnitude
SCALE_FLOOR = 1e-12  # an all-zero vector's scale: its numbers stay 0


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] as e4m3 numbers [..., D] and one float32 scale per vector [...]: the
    vector's largest magnitude over :data:`FP8_MAX`, so ``numbers * scale`` restores it."""
    wide = x.float()
    scale = wide.abs().amax(dim=-1).clamp_min(SCALE_FLOOR) / FP8_MAX
    numbers = (wide / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return numbers, scale


def fp8_dequantize(numbers: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What :func:`fp8_quantize` stored, back in ``dtype`` (the product taken in float32)."""
    return (numbers.float() * scale[..., None]).to(dtype)


@dataclass
class LayerKV:
    """One layer's keys and values [slots, kv_heads, positions, head_dim]; in fp8 storage also
    their scales [slots, kv_heads, positions] (float32), else ``None``. ``dtype``: the model's
    (what :meth:`read` returns)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None
    dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    def write(self, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Put ``k``/``v`` [B, S, kv_heads, head_dim] at row ``rows[i]`` ([B, 1]) and positions
        ``positions`` [B, S]."""
        if not self.quantized:
            self.keys[rows, :, positions] = k
            self.values[rows, :, positions] = v
            return
        for store, scales, x in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
            numbers, scale = fp8_quantize(x)
            # indexed through a byte view: the same bits, and an index_put every backend has
            store.view(torch.uint8)[rows, :, positions] = numbers.view(torch.uint8)
            scales[rows, :, positions] = scale

    def read(self, index: torch.Tensor | slice, span: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the slots ``index`` selects, positions ``0..span-1`` (all when
        ``span`` is None), in the model's dtype."""
        end = self.keys.shape[2] if span is None else span
        if not self.quantized:
            return self.keys[:, :, :end][index], self.values[:, :, :end][index]
        return tuple(
            fp8_dequantize(store.view(torch.uint8)[:, :, :end][index].view(FP8_DTYPE),
                           scales[:, :, :end][index], self.dtype)
            for store, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)))


class SlotKVCache:
    """Keys and values of ``num_slots`` streams, ``max_positions`` each, plus one scratch position.

    The scratch position (index ``max_positions``) absorbs writes of padded or idle rows; no
    mask ever lets a query see it. ``keys``/``values`` are per-layer views of one tensor each
    (``all_keys``/``all_values``, [layers, slots, kv_heads, positions, head_dim]), so a span of
    positions of every layer is written in one copy; ``layers`` are the same views as
    :class:`LayerKV`. ``kv_dtype``: ``"auto"`` (``dtype``) or ``"fp8_e4m3"`` (module doc).
    """

    def __init__(self, shape, num_slots: int, max_positions: int, device: torch.device,
                 dtype: torch.dtype, kv_dtype: str = "auto") -> None:
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_CACHE_DTYPES}, not {kv_dtype!r}")
        size = (shape.num_layers, num_slots, shape.num_kv_heads, max_positions + 1, shape.head_dim)
        stored = FP8_DTYPE if kv_dtype == "fp8_e4m3" else dtype
        self.all_keys = torch.zeros(size, device=device, dtype=stored)
        self.all_values = torch.zeros(size, device=device, dtype=stored)
        self.keys = list(self.all_keys.unbind(0))
        self.values = list(self.all_values.unbind(0))
        self.all_key_scales = self.all_value_scales = None
        key_scales: list = [None] * shape.num_layers
        value_scales: list = [None] * shape.num_layers
        if kv_dtype == "fp8_e4m3":
            self.all_key_scales = torch.zeros(size[:-1], device=device, dtype=torch.float32)
            self.all_value_scales = torch.zeros(size[:-1], device=device, dtype=torch.float32)
            key_scales = list(self.all_key_scales.unbind(0))
            value_scales = list(self.all_value_scales.unbind(0))
        self.layers = [LayerKV(*parts, dtype) for parts in
                       zip(self.keys, self.values, key_scales, value_scales)]
        self.kv_dtype = kv_dtype
        self.num_slots = num_slots
        self.max_positions = max_positions
        self.scratch_position = max_positions

    @property
    def quantized(self) -> bool:
        return self.all_key_scales is not None

    def _stores(self) -> list[torch.Tensor]:
        stores = [self.all_keys, self.all_values]
        if self.quantized:
            stores += [self.all_key_scales, self.all_value_scales]
        return stores

    @property
    def bytes_per_slot(self) -> int:
        return sum(store[:, 0].numel() * store.element_size() for store in self._stores())

    def clear_slot(self, slot: int, upto: int | None = None) -> None:
        """Zero a slot's positions ``[0, upto)`` (all when ``upto`` is None)."""
        end = self.max_positions + 1 if upto is None else upto
        for store in self._stores():
            store[:, slot, :, :end].zero_()

    def write_prefix(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put keys/values [layers, kv_heads, n, head_dim] at a slot's positions ``0..n-1``."""
        self._require_model_storage()
        count = keys.shape[2]
        self.all_keys[:, slot, :, :count] = keys
        self.all_values[:, slot, :, :count] = values

    def read_prefix(self, slot: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of a slot's keys/values at positions ``0..count-1`` (``write_prefix``'s form)."""
        self._require_model_storage()
        return (self.all_keys[:, slot, :, :count].clone(),
                self.all_values[:, slot, :, :count].clone())

    def _require_model_storage(self) -> None:
        if self.quantized:  # only the LLM's cache copies prefixes, and it keeps the model's dtype
            raise NotImplementedError("prefix copies need a cache in the model's dtype")
