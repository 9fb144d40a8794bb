"""Decode-step attention: the two-matmul kernel and the block-sparse FlexAttention kernel agree
with torch's fused attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serve_app.engines.minicpmo.model.flex_attention import (
    flex_one_query_attention,
    visible_blocks,
)
from serve_app.engines.minicpmo.model.layers import one_query_attention


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


@pytest.mark.parametrize("heads, kv_heads", [(12, 12), (28, 4)])
def test_flex_attention_reads_only_the_blocks_a_row_sees_and_matches_fused_attention(heads, kv_heads):
    generator = torch.Generator().manual_seed(heads)
    batch, positions, dim, block = 4, 700, 16, 128  # 6 blocks, the last one partial
    q = torch.randn(batch, heads, 1, dim, generator=generator)
    keys = torch.randn(batch, kv_heads, positions, dim, generator=generator)
    values = torch.randn(batch, kv_heads, positions, dim, generator=generator)
    index = torch.arange(positions)
    # a short row, a row with a hole across a block edge, a full row, and an inactive row
    # that sees key 0 only
    attend = torch.stack([index <= 90,
                          (index <= 650) & ~((index > 100) & (index < 300)),
                          index < positions,
                          index == 0])[:, None, None, :]
    mask = visible_blocks(attend, block)
    read = mask.kv_num_blocks[:, 0, 0] + mask.full_kv_num_blocks[:, 0, 0]
    assert read.tolist() == [1, 5, 6, 1]  # row 1 skips block 1 (keys 128-255), hidden whole
    assert mask.full_kv_num_blocks[:, 0, 0].tolist() == [0, 2, 5, 0]  # row 1: blocks 3 and 4
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend,
                                          enable_gqa=heads != kv_heads)
    got = flex_one_query_attention(q, keys, values, attend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_layers_share_one_block_mask_per_step():
    """The first layer that attends with flex builds the step's block mask and every layer
    reads it: a decoder step over a cache gives the SDPA step's output, leaves the mask in the
    step, and a step handed a mask that hides most keys attends through that mask instead."""
    from serve_app.engines.minicpmo.model.layers import (
        DecoderShape,
        SlotDecoder,
        SlotKVCache,
        StepInputs,
        set_one_query_attention,
    )

    torch.manual_seed(0)
    shape = DecoderShape(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                         num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=False)
    decoder = SlotDecoder(shape).eval()
    cache = SlotKVCache(shape, 3, 300, torch.device("cpu"), torch.float32)
    for store in (cache.all_keys, cache.all_values):
        store.normal_()
    positions = torch.tensor([5, 140, 299])
    index = torch.arange(cache.max_positions + 1)
    attend = (index[None, :] <= positions[:, None])[:, None, None, :]
    hidden = torch.randn(3, 1, 32)

    def step(block_mask=None) -> StepInputs:
        return StepInputs(torch.arange(3), positions[:, None], positions[:, None], attend, True,
                          block_mask)

    with torch.inference_mode():
        set_one_query_attention(decoder, "sdpa")
        want = decoder(hidden, cache, step())
        set_one_query_attention(decoder, "flex")
        flex_step = step()
        got = decoder(hidden, cache, flex_step)
        assert flex_step.block_mask is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # handed the mask of "key 0 only", the layers attend as SDPA does under that mask
        key_zero = torch.zeros_like(attend).index_fill_(-1, torch.tensor([0]), True)
        through_given_mask = decoder(hidden, cache, step(visible_blocks(key_zero)))
        set_one_query_attention(decoder, "sdpa")
        key_zero_step = StepInputs(torch.arange(3), positions[:, None], positions[:, None],
                                   key_zero, True)
        torch.testing.assert_close(through_given_mask, decoder(hidden, cache, key_zero_step),
                                   rtol=1e-5, atol=1e-5)
