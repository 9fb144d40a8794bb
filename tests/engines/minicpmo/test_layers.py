"""Decode-step attention: the two-matmul kernel agrees with torch's fused attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_app.engines.minicpmo.layers import one_query_attention


@pytest.mark.parametrize("heads, kv_heads", [(12, 12), (28, 4)])
def test_one_query_attention_matches_fused_attention(heads, kv_heads):
    generator = torch.Generator().manual_seed(heads)
    batch, positions, dim = 3, 40, 16
    q = torch.randn(batch, heads, 1, dim, generator=generator)
    keys = torch.randn(batch, kv_heads, positions, dim, generator=generator)
    values = torch.randn(batch, kv_heads, positions, dim, generator=generator)
    # per row a different visible set: a causal limit with a hidden hole, as audio rows have
    index = torch.arange(positions)
    attend = torch.stack([(index <= limit) & ~((index > 5) & (index < 5 + hole))
                          for limit, hole in ((39, 10), (20, 0), (7, 2))])[:, None, None, :]
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend,
                                          enable_gqa=heads != kv_heads)
    got = one_query_attention(q, keys, values, attend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
