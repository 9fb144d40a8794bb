"""Attention of one query per row over two ranges of that row's cache positions.

An audio query of the TTS model sees the written, released part of the text (positions
``0 .. a_end - 1``) and the audio so far (``b_start .. b_end - 1``: every frame up to its own);
the reserved text positions between them are never seen (docs/minicpmo.md, "Attention in the
TTS model"). FlexAttention with a block mask reads whole 128-key blocks, so a row also reads
the unwritten end of its text block, the positions before the audio in its block and the end
of its last audio block: about 1.4 times the keys it sees at a 10 s read.

On CUDA, :func:`rope_write_two_range_attention` does a decode step's attention from the q/k/v
projections on in one Triton kernel, one program per row and head: the rotary embedding of
the query and the new key, the new key and value written into the cache, and an online
softmax in float32 over tiles of :data:`KEY_TILE` keys of the two ranges, as FlashAttention's
decode does; it reads the cache rows in place through the row's slot index (no gathered copy)
and replaces the rotary, cache-write and attention kernels of every layer (eight launches)
with one. Elsewhere the layers rotate, write and call
:func:`reference_two_range_attention`: SDPA over the mask the ranges describe, the reference
the tests compare the kernel with (Triton's interpreter runs it on the CPU). Hand-written: the
two ranges per row are this model's visibility rule, which the decode kernels of FlashInfer and
FlashAttention (one key prefix per row, or a page list) do not express without a paged cache.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# keys per tile of the kernel's loop and warps per program, by the cache's dtype: timed on an
# H100 at 768-1024 rows of a read-like spread of keys (scripts/bench_range_kernel.py), bf16 is
# fastest at 64 keys and 4 warps (0.54 ms a layer at 1024 rows) and fp8 at 128 and 2 (0.36
# ms; at 64 and 4 it took 0.58): an fp8 tile of 128 keys moves the bytes a bf16 tile of 64 does
KEY_TILE = 64
KERNEL_WARPS = 4
FP8_KEY_TILE = 128
FP8_KERNEL_WARPS = 2


def ranges_mask(ranges: torch.Tensor, key_count: int) -> torch.Tensor:
    """The boolean visibility [B, 1, 1, key_count] that ``ranges`` [B, 3] (a_end, b_start,
    b_end per row) describe."""
    keys = torch.arange(key_count, device=ranges.device)[None, :]
    visible = (keys < ranges[:, :1]) | ((keys >= ranges[:, 1:2]) & (keys < ranges[:, 2:3]))
    return visible[:, None, None, :]


def reference_two_range_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                  ranges: torch.Tensor) -> torch.Tensor:
    """Attention of one query per row, ``q`` [B, H, 1, D], over its row's keys/values
    [B, Hkv, T, D] (gathered from the cache, in the model's dtype) at the positions ``ranges``
    [B, 3] (a_end, b_start, b_end per row) give: ``[0, a_end)`` and ``[b_start, b_end)``
    (``a_end <= b_start``; an empty second range has ``b_end <= b_start``), as SDPA over the
    ranges' mask. Returns [B, H, 1, D]."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    return F.scaled_dot_product_attention(q, keys, values,
                                          attn_mask=ranges_mask(ranges, keys.shape[2]),
                                          enable_gqa=heads != kv_heads)


def rope_write_two_range_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                                   values: torch.Tensor, rows: torch.Tensor,
                                   write_positions: torch.Tensor, ranges: torch.Tensor,
                                   key_scales: torch.Tensor | None = None,
                                   value_scales: torch.Tensor | None = None,
                                   kernel=None) -> torch.Tensor:
    """A decode step's attention from the projections on, in one kernel: rotate the queries
    ``q`` [B, H, D] and the keys ``k`` [B, Hkv, D] (transformers' rotary formula, rounded to the
    model's dtype, ``q``'s, after each operation as torch's elementwise kernels round), write
    ``k`` and ``v`` [B, Hkv, D] into row i's slot ``rows[i]`` at ``write_positions[i]``, and
    attend over the ``ranges`` (as :func:`reference_two_range_attention`; the new key is taken
    from registers, not read back). ``cos``/``sin`` [B, D]; ``rows``, ``write_positions`` [B]
    and ``ranges`` [B, 3] integer (views of wider tensors too). An fp8 cache (``keys``/``values``
    in e4m3) comes with ``key_scales``/``value_scales`` [slots, Hkv, T] float32: the new key
    and value are quantized as :func:`.kv_cache.fp8_quantize` does and attended to as stored.
    Returns [B, H, D]. ``kernel``: a :func:`build_rope_write_attention_kernel` (default:
    compiled once, CUDA)."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    for name, tensor in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin),
                         ("keys", keys), ("values", values)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if keys.stride() != values.stride() or cos.stride() != sin.stride():
        raise ValueError("keys/values and cos/sin must share their layouts")
    scaled = key_scales is not None
    if scaled and (value_scales is None or key_scales.stride() != value_scales.stride()
                   or key_scales.stride(-1) != 1):
        raise ValueError("key and value scales go together, in one contiguous layout")
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    # without scales the scale pointers are never read: the keys stand in for them
    scale_k, scale_v = (key_scales, value_scales) if scaled else (keys, values)
    scale_strides = key_scales.stride()[:2] if scaled else (0, 0)
    (kernel or _compiled_kernel())[(batch, heads)](
        q, k, v, cos, sin, keys, values, scale_k, scale_v, out, rows, write_positions, ranges,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), keys.stride(0), keys.stride(1), keys.stride(2), *scale_strides,
        rows.stride(0), write_positions.stride(0), ranges.stride(0), ranges.stride(1),
        dim ** -0.5, GROUP=heads // kv_heads, DIM=dim,
        TILE=FP8_KEY_TILE if scaled else KEY_TILE, SCALED=scaled,
        num_warps=FP8_KERNEL_WARPS if scaled else KERNEL_WARPS)
    return out


@functools.cache
def _compiled_kernel():
    return build_rope_write_attention_kernel()


def build_rope_write_attention_kernel():
    """The Triton kernel (a new ``triton.jit`` function: Triton's interpreter runs it where
    ``TRITON_INTERPRET=1`` was set before Triton was first imported)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rope_write_attention_kernel(
            q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_k, cache_v, scale_k, scale_v, out_ptr,
            rows_ptr, write_ptr, ranges_ptr, stride_qb, stride_qh, stride_kb, stride_kh,
            stride_vb, stride_vh, stride_cos, stride_slot, stride_head, stride_t,
            stride_scale_slot, stride_scale_head, stride_rows, stride_write, stride_range_row,
            stride_range_end, scale,
            GROUP: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr, SCALED: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        heads = tl.num_programs(1)
        kv_head = head // GROUP
        model_dtype = q_ptr.dtype.element_ty
        cache_dtype = cache_k.dtype.element_ty
        dims = tl.arange(0, DIM)
        half = DIM // 2
        # rotate_half(x)[d] = -x[d + D/2] for d < D/2, x[d - D/2] after
        turned = tl.where(dims < half, dims + half, dims - half)
        sign = tl.where(dims < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + row * stride_cos + dims).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_cos + dims).to(tl.float32)

        q_row = q_ptr + row * stride_qb + head * stride_qh
        q = tl.load(q_row + dims).to(tl.float32)
        q_turned = tl.load(q_row + turned).to(tl.float32) * sign
        q = ((q * cos).to(model_dtype).to(tl.float32)
             + (q_turned * sin).to(model_dtype).to(tl.float32)).to(model_dtype).to(tl.float32)
        k_row = k_ptr + row * stride_kb + kv_head * stride_kh
        k_new = tl.load(k_row + dims).to(tl.float32)
        k_turned = tl.load(k_row + turned).to(tl.float32) * sign
        k_new = ((k_new * cos).to(model_dtype).to(tl.float32)
                 + (k_turned * sin).to(model_dtype).to(tl.float32)).to(model_dtype).to(tl.float32)
        v_new = tl.load(v_ptr + row * stride_vb + kv_head * stride_vh + dims).to(tl.float32)
        if SCALED:  # fp8: numbers and a scale per vector, as kv_cache.fp8_quantize makes them
            k_scale = tl.maximum(tl.max(tl.abs(k_new), axis=0), 1.0e-12) / 448.0
            v_scale = tl.maximum(tl.max(tl.abs(v_new), axis=0), 1.0e-12) / 448.0
            k_fit = tl.minimum(tl.maximum(k_new / k_scale, -448.0), 448.0)
            v_fit = tl.minimum(tl.maximum(v_new / v_scale, -448.0), 448.0)
            # rounded onto e4m3's grid here (to nearest, ties to even, as CUDA converts), so the
            # conversion is exact: Triton's interpreter (the CPU tests) drops the carry when a
            # rounding crosses a power of two. Normal numbers keep 3 of float32's 23 mantissa
            # bits; below 2**-6 (subnormal) the grid is 2**-9, which adding and taking away
            # 1.5 * 2**14 (whose float32 step is 2**-9) rounds to
            k_bits = k_fit.to(tl.int32, bitcast=True)
            v_bits = v_fit.to(tl.int32, bitcast=True)
            k_grid = ((k_bits + 0x7FFFF + ((k_bits >> 20) & 1)) & -1048576).to(tl.float32,
                                                                               bitcast=True)
            v_grid = ((v_bits + 0x7FFFF + ((v_bits >> 20) & 1)) & -1048576).to(tl.float32,
                                                                               bitcast=True)
            k_grid = tl.where(tl.abs(k_fit) < 0.015625, (k_fit + 24576.0) - 24576.0, k_grid)
            v_grid = tl.where(tl.abs(v_fit) < 0.015625, (v_fit + 24576.0) - 24576.0, v_grid)
            k_stored = k_grid.to(cache_dtype)
            v_stored = v_grid.to(cache_dtype)
            k_new = k_grid * k_scale  # attended to as a later step reads it
            v_new = v_grid * v_scale
        else:
            k_stored = k_new.to(cache_dtype)
            v_stored = v_new.to(cache_dtype)
            k_new = k_stored.to(tl.float32)
            v_new = v_stored.to(tl.float32)

        slot = tl.load(rows_ptr + row * stride_rows).to(tl.int64)
        written = tl.load(write_ptr + row * stride_write).to(tl.int32)
        base = slot * stride_slot + kv_head * stride_head
        scale_base = slot * stride_scale_slot + kv_head * stride_scale_head
        if head % GROUP == 0:  # one program per key/value head writes it
            tl.store(cache_k + base + written.to(tl.int64) * stride_t + dims, k_stored)
            tl.store(cache_v + base + written.to(tl.int64) * stride_t + dims, v_stored)
            if SCALED:
                tl.store(scale_k + scale_base + written.to(tl.int64), k_scale)
                tl.store(scale_v + scale_base + written.to(tl.int64), v_scale)

        ends = ranges_ptr + row * stride_range_row
        a_end = tl.load(ends).to(tl.int32)
        b_start = tl.load(ends + stride_range_end).to(tl.int32)
        b_end = tl.load(ends + 2 * stride_range_end).to(tl.int32)
        a_tiles = (a_end + TILE - 1) // TILE
        b_tiles = (tl.maximum(b_end - b_start, 0) + TILE - 1) // TILE
        m_i = tl.zeros([1], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([DIM], dtype=tl.float32)
        # the first range's tiles, then the second's, in one loop; the written position is
        # left out here (another program may be writing it) and added from registers below
        for tile in range(0, a_tiles + b_tiles):
            in_first = tile < a_tiles
            start = tl.where(in_first, tile * TILE, b_start + (tile - a_tiles) * TILE)
            end = tl.where(in_first, a_end, b_end)
            offsets = start + tl.arange(0, TILE)
            inside = (offsets < end) & (offsets != written)
            where = base + offsets[:, None].to(tl.int64) * stride_t + dims[None, :]
            keys = tl.load(cache_k + where, mask=inside[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(keys * q[None, :], axis=1) * scale
            if SCALED:  # a key's scale multiplies its score, a value's scale its weight
                scores = scores * tl.load(scale_k + scale_base + offsets, mask=inside, other=0.0)
            scores = tl.where(inside, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new)
            weights = p
            if SCALED:
                weights = p * tl.load(scale_v + scale_base + offsets, mask=inside, other=0.0)
            vals = tl.load(cache_v + where, mask=inside[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(weights[:, None] * vals, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        sees_new = (written < a_end) | ((written >= b_start) & (written < b_end))
        score = tl.sum(k_new * q, axis=0) * scale
        score = tl.where(sees_new, score, float("-inf"))
        m_new = tl.maximum(m_i, score)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(score - m_new)
        acc = acc * alpha + p * v_new
        l_i = l_i * alpha + p
        out = acc / l_i
        tl.store(out_ptr + (row * heads + head) * DIM + dims, out.to(out_ptr.dtype.element_ty))

    return rope_write_attention_kernel
