"""Attention of one query per row over two ranges of that row's cache positions.

An audio query of the TTS model sees the written, released part of the text (positions
``0 .. a_end - 1``) and the audio so far (``b_start .. b_end - 1``: ``[Ptts]`` and every
frame up to its own); the reserved text positions between them are never seen
(docs/minicpmo.md, "Attention in the TTS model"). :func:`two_range_attention` reads exactly
those keys: FlexAttention with a block mask reads whole 128-key blocks, so a row also reads
the unwritten end of its text block, the 46 positions before ``[Ptts]`` and the end of its
last audio block, about 1.4 times the keys it sees at a 10 s read.

On CUDA it is a Triton kernel (one program per row and head, an online softmax in float32
over tiles of :data:`KEY_TILE` keys, as FlashAttention's decode does); it reads the cache rows
in place through the row's slot index, so no gathered copy of the rows' keys is made. On
other devices it is SDPA over the mask the ranges describe (the reference the tests compare
the kernel with, run by Triton's interpreter on the CPU). Hand-written: the two ranges per
row are this model's visibility rule, which the decode kernels of FlashInfer and FlashAttention
(one key prefix per row, or a page list) do not express without a paged cache.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KEY_TILE = 64  # keys per tile of the kernel's loop
KERNEL_WARPS = 4


def ranges_mask(ranges: torch.Tensor, key_count: int) -> torch.Tensor:
    """The boolean visibility [B, 1, 1, key_count] that ``ranges`` [B, 3] (a_end, b_start,
    b_end per row) describe."""
    keys = torch.arange(key_count, device=ranges.device)[None, :]
    visible = (keys < ranges[:, :1]) | ((keys >= ranges[:, 1:2]) & (keys < ranges[:, 2:3]))
    return visible[:, None, None, :]


def reference_two_range_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                  rows: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """:func:`two_range_attention` as SDPA over the rows' gathered keys and the ranges' mask."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    return F.scaled_dot_product_attention(q, keys[rows], values[rows],
                                          attn_mask=ranges_mask(ranges, keys.shape[2]),
                                          enable_gqa=heads != kv_heads)


def two_range_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        rows: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """Attention of one query per row: ``q`` [B, H, 1, D]; ``keys``/``values`` a layer's whole
    cache [slots, Hkv, T, D], of which row i reads slot ``rows[i]``; ``ranges`` [B, 3] int
    (a_end, b_start, b_end): row i sees key positions ``[0, a_end)`` and ``[b_start, b_end)``
    (``a_end`` >= 1, ``a_end <= b_start``; an empty second range has ``b_end <= b_start``).
    Returns [B, H, 1, D] in ``q``'s dtype."""
    if q.is_cuda:
        return launch_two_range_kernel(_compiled_kernel(), q, keys, values, rows, ranges)
    return reference_two_range_attention(q, keys, values, rows, ranges)


def launch_two_range_kernel(kernel, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            rows: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """Run ``kernel`` (:func:`build_two_range_kernel`'s) over the rows; tensors on one device."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or keys.stride() != values.stride():
        raise ValueError("keys and values must share one layout with contiguous head dims")
    out = torch.empty((batch, heads, 1, dim), dtype=q.dtype, device=q.device)
    ranges = ranges.to(torch.int32)
    rows = rows.to(torch.int32)
    kernel[(batch, heads)](
        q, keys, values, out, rows, ranges,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        dim ** -0.5, GROUP=heads // kv_heads, DIM=dim, TILE=KEY_TILE, num_warps=KERNEL_WARPS)
    return out


@functools.cache
def _compiled_kernel():
    return build_two_range_kernel()


def build_two_range_kernel():
    """The Triton kernel (a new ``triton.jit`` function: Triton's interpreter runs it where
    ``TRITON_INTERPRET=1`` was set before this call)."""
    import triton
    import triton.language as tl

    @triton.jit
    def two_range_kernel(q_ptr, k_ptr, v_ptr, out_ptr, rows_ptr, ranges_ptr,
                         stride_qb, stride_qh, stride_kslot, stride_kh, stride_kt, scale,
                         GROUP: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        heads = tl.num_programs(1)
        slot = tl.load(rows_ptr + row).to(tl.int64)
        a_end = tl.load(ranges_ptr + row * 3)
        b_start = tl.load(ranges_ptr + row * 3 + 1)
        b_end = tl.load(ranges_ptr + row * 3 + 2)
        a_tiles = (a_end + TILE - 1) // TILE
        b_tiles = (tl.maximum(b_end - b_start, 0) + TILE - 1) // TILE
        dims = tl.arange(0, DIM)
        q = tl.load(q_ptr + row * stride_qb + head * stride_qh + dims).to(tl.float32)
        base = slot * stride_kslot + (head // GROUP) * stride_kh
        m_i = tl.zeros([1], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([DIM], dtype=tl.float32)
        # the first range's tiles, then the second's, in one loop
        for tile in range(0, a_tiles + b_tiles):
            in_first = tile < a_tiles
            start = tl.where(in_first, tile * TILE, b_start + (tile - a_tiles) * TILE)
            end = tl.where(in_first, a_end, b_end)
            offsets = start + tl.arange(0, TILE)
            inside = offsets < end
            where = base + offsets[:, None].to(tl.int64) * stride_kt + dims[None, :]
            k = tl.load(k_ptr + where, mask=inside[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1) * scale
            scores = tl.where(inside, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new)
            v = tl.load(v_ptr + where, mask=inside[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        out = acc / l_i
        tl.store(out_ptr + (row * heads + head) * DIM + dims, out.to(out_ptr.dtype.element_ty))

    return two_range_kernel
