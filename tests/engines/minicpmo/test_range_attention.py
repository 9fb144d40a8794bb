"""Decode attention over the two ranges of keys an audio query sees (model/range_attention.py):
the ranges the audio step derives mark exactly the keys of its visibility mask, and the Triton
kernel (run by Triton's interpreter on the CPU) computes what the attention layer computes
without it: rotary embedding, cache write, SDPA over the ranges' mask."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve_app.engines.minicpmo.device.audio_step import (
    AudioStepInputs,
    audio_visibility,
    audio_visible_ranges,
    window_key_reads,
)
from serve_app.engines.minicpmo.model.layers import (
    DecoderShape,
    LayerKV,
    SlotAttention,
    SlotKVCache,
    StepInputs,
    rotary_cos_sin,
)
from serve_app.engines.minicpmo.model.modeling import TTSConfig
from serve_app.engines.minicpmo.model.range_attention import (
    build_rope_write_attention_kernel,
    ranges_mask,
    reference_two_range_attention,
    rope_write_two_range_attention,
)

ROOT = Path(__file__).resolve().parents[3]
CFG = TTSConfig(llm_dim=8, hidden_size=8, intermediate_size=8, num_attention_heads=2,
                num_hidden_layers=1)  # the real model's text layout (303 condition positions)


def random_rows(count: int, seed: int, lowest: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    text_len = torch.randint(1, CFG.streaming_text_reserved_len + 1, (count,), generator=generator)
    limit = torch.randint(lowest, 1025, (count,), generator=generator)
    return text_len, limit


def test_the_ranges_mark_exactly_the_keys_of_the_visibility_mask():
    keys = torch.arange(1025)
    text_len, limit = random_rows(20000, 0, 0)
    ranges = audio_visible_ranges(limit, limit, text_len, CFG)
    assert torch.equal(ranges_mask(ranges, 1025)[:, 0, 0],
                       audio_visibility(keys, limit, limit, text_len, CFG))
    assert bool((ranges[:, 0] <= ranges[:, 1]).all())
    # an audio step (from [Ptts] at 302 on) always sees [Stts], so the first range is never empty
    text_len, limit = random_rows(20000, 1, CFG.audio_bos_position)
    assert bool((audio_visible_ranges(limit, limit, text_len, CFG)[:, 0] >= 1).all())


def test_the_ranges_skip_the_reserved_text_and_release_it_every_50_frames():
    def ranges_at(position: int, text_len: int = 100) -> list[int]:
        at = torch.tensor([position])
        return audio_visible_ranges(at, at, torch.tensor([text_len]), CFG)[0].tolist()

    # [Stts] [spk], then 10 text positions per 50 frames released; [Ptts] (302) stays hidden
    # (the reserved text's hidden part runs to it), so the audio range starts at 303
    assert ranges_at(303) == [2 + 10, 303, 304]
    assert ranges_at(350) == [2 + 10, 303, 351]
    assert ranges_at(351) == [2 + 20, 303, 352]
    assert ranges_at(800) == [2 + 100, 303, 801]  # 100 of 100 tokens; [Etts] (at 102) not yet
    assert ranges_at(800, text_len=30) == [2 + 30 + 1, 303, 801]  # all the text and [Etts]


def test_window_key_reads_counts_exactly_the_keys_the_rows_see():
    text_len, limit = random_rows(50, 2, CFG.audio_bos_position)
    x = AudioStepInputs.from_steps([], [], [], False, CFG.num_vq)
    x.position, x.text_len = limit.clamp(max=1000), text_len
    keys = torch.arange(1025)
    seen = sum(int(audio_visibility(keys, x.position + s, x.position + s, text_len, CFG).sum())
               for s in range(5))
    assert window_key_reads(x, 64, 5, 1025, "visible_ranges", CFG) == seen + (64 - 50) * 5
    assert window_key_reads(x, 64, 5, 1025, "sdpa", CFG) == 64 * 5 * 1025


def check_kernel_against_the_layer(kv_heads: int, dtype: torch.dtype, kv_dtype: str = "auto",
                                   heads: int = 4, head_dim: int = 64) -> None:
    """The kernel (as Triton's interpreter runs it: ``TRITON_INTERPRET=1`` must be set before
    anything imports Triton, which transformers does) against the attention layer's own path
    off CUDA (rotary embedding, cache write, SDPA over the ranges' mask): the layer's output
    and both caches after the step, in the model's dtype or in fp8 with scales."""
    torch.manual_seed(kv_heads)
    shape = DecoderShape(hidden_size=heads * head_dim, intermediate_size=64, num_layers=1,
                         num_heads=heads, num_kv_heads=kv_heads, rope_theta=10000.0, rms_norm_eps=1e-6,
                         qkv_bias=True)
    layer = SlotAttention(shape).to(dtype)
    layer.fuse_projections()
    cache = SlotKVCache(shape, 7, 299, torch.device("cpu"), dtype, kv_dtype=kv_dtype)
    if cache.quantized:  # random vectors stored as the cache stores them
        rows_all = torch.arange(7)[:, None, None].expand(7, 300, 1).reshape(7, 300)
        positions = torch.arange(300)[None].expand(7, 300)
        for store in (cache.all_keys, cache.all_values):
            assert store.shape[1:] == (7, kv_heads, 300, head_dim)
        cache.layers[0].write(rows_all[:, :1], positions,
                              torch.randn(7, 300, kv_heads, head_dim).to(dtype),
                              torch.randn(7, 300, kv_heads, head_dim).to(dtype))
    else:
        cache.all_keys.normal_()
        cache.all_values.normal_()
    rows = torch.tensor([6, 0, 3, 2, 5])  # gathered by slot, out of order
    ranges = torch.tensor([[1, 0, 0],        # a padding row: key 0 only, writes to scratch
                           [70, 150, 299],   # both ranges cross tile boundaries
                           [3, 100, 101],    # the new key alone in the second range
                           [64, 64, 130],    # the ranges touch
                           [200, 250, 240]])  # an empty second range: the new key is at 199
    written = torch.tensor([cache.scratch_position, 298, 100, 129, 199])
    positions = torch.tensor([5, 298, 100, 129, 199])
    hidden = torch.randn(len(rows), 1, shape.hidden_size).to(dtype)
    cos, sin = rotary_cos_sin(positions[:, None], shape.head_dim, shape.rope_theta, dtype)
    step = StepInputs(rows, positions[:, None], written[:, None],
                      ranges_mask(ranges, cache.max_positions + 1), ranges=ranges)
    layer.one_query_kernel = "visible_ranges"
    kv = cache.layers[0]
    reference = LayerKV(*(None if t is None else t.clone() for t in
                          (kv.keys, kv.values, kv.key_scales, kv.value_scales)), dtype)
    want = layer(hidden, cos, sin, reference, step)

    q, k, v = layer._projections(hidden)
    # the integer inputs as columns of one wider tensor, as the audio step's packed inputs are
    packed = torch.cat([rows[:, None], written[:, None], ranges.flip(1), ranges], dim=1)
    out = rope_write_two_range_attention(
        q[:, 0], k[:, 0], v[:, 0], cos[:, 0], sin[:, 0], kv.keys, kv.values,
        packed[:, 0], packed[:, 1], packed[:, 5:], kv.key_scales, kv.value_scales,
        kernel=build_rope_write_attention_kernel())
    got = layer.o_proj(out.reshape(len(rows), 1, -1))
    got_keys, got_values = kv.read(slice(None))
    want_keys, want_values = reference.read(slice(None))
    if dtype == torch.float32 and not cache.quantized:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_keys, want_keys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_values, want_values, rtol=0, atol=0)
        return
    if cache.quantized:
        # fp8: the same scales and numbers, at most one e4m3 step (1/8) apart: the interpreter
        # rounds a conversion toward zero, torch (and CUDA's Triton) to nearest; and the same
        # attention over them
        torch.testing.assert_close(kv.value_scales, reference.value_scales, rtol=1e-6, atol=0)
        torch.testing.assert_close(kv.key_scales, reference.key_scales, rtol=0.02, atol=1e-6)
        for got_x, want_x in ((got_keys, want_keys), (got_values, want_values)):
            torch.testing.assert_close(got_x.float(), want_x.float(), rtol=0.13, atol=0.02)
        torch.testing.assert_close(got.float(), want.float(), rtol=0.03, atol=0.03)
        return
    # bfloat16: torch rounds each elementwise result to nearest, the interpreter toward zero
    # (CUDA's Triton to nearest), so a rotated key may differ in its last bits
    assert torch.equal(got_values, want_values)
    torch.testing.assert_close(got_keys.float(), want_keys.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.03, atol=0.03)


@pytest.mark.parametrize("kv_heads,dtype,kv_dtype,heads,head_dim",
                         [(4, "float32", "auto", 4, 64), (2, "float32", "auto", 4, 64),
                          (4, "bfloat16", "auto", 4, 64), (4, "float32", "fp8_e4m3", 4, 64),
                          (2, "bfloat16", "fp8_e4m3", 4, 64), (1, "bfloat16", "auto", 7, 128)],
                         ids=["one-key-head-per-query-head", "grouped", "bfloat16", "fp8",
                              "fp8-grouped-bfloat16", "qwen2-like-group-of-7-dim-128"])
def test_the_kernel_computes_what_the_attention_layer_computes(kv_heads, dtype, kv_dtype, heads,
                                                               head_dim):
    """The last case has the chat LLM's head shape (Qwen2: 7 query heads per key/value head,
    head dimension 128), whose decode step uses the kernel with ``visible_ranges``."""
    pytest.importorskip("triton")  # scripts/setup installs it with the test extra
    # a process of its own: the interpreter mode must be on before Triton is first imported
    code = ("import torch; from tests.engines.minicpmo.test_range_attention import "
            f"check_kernel_against_the_layer as check; check({kv_heads}, torch.{dtype}, "
            f"{kv_dtype!r}, {heads}, {head_dim})")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_off_cuda_the_layer_attends_over_the_ranges_mask():
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 2, 40, 8, generator=generator)
    values = torch.randn(3, 2, 40, 8, generator=generator)
    q = torch.randn(2, 2, 1, 8, generator=generator)
    rows, ranges = torch.tensor([2, 1]), torch.tensor([[5, 20, 31], [1, 0, 0]])
    visible = torch.zeros(2, 1, 1, 40, dtype=torch.bool)
    visible[0, ..., :5] = visible[0, ..., 20:31] = visible[1, ..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, keys[rows], values[rows],
                                                             attn_mask=visible)
    torch.testing.assert_close(reference_two_range_attention(q, keys[rows], values[rows], ranges),
                               want)
