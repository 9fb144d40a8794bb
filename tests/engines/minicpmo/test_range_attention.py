"""Decode attention over the two ranges of keys an audio query sees (model/range_attention.py):
the ranges the audio step derives mark exactly the keys of its visibility mask, and the Triton
kernel (run by Triton's interpreter on the CPU) computes what SDPA over that mask computes."""

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
from serve_app.engines.minicpmo.model.modeling import TTSConfig
from serve_app.engines.minicpmo.model.range_attention import (
    build_two_range_kernel,
    launch_two_range_kernel,
    ranges_mask,
    reference_two_range_attention,
    two_range_attention,
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


def check_kernel_against_sdpa(kv_heads: int) -> None:
    """The kernel (as Triton's interpreter runs it: ``TRITON_INTERPRET=1`` must be set before
    anything imports Triton, which transformers does) against SDPA over the ranges' mask."""
    kernel = build_two_range_kernel()
    generator = torch.Generator().manual_seed(kv_heads)
    slots, heads, positions, dim = 7, 4, 300, 64
    keys = torch.randn(slots, kv_heads, positions, dim, generator=generator)
    values = torch.randn(slots, kv_heads, positions, dim, generator=generator)
    rows = torch.tensor([6, 0, 3, 2, 5])  # gathered by slot, out of order
    ranges = torch.tensor([[1, 0, 0],        # a padding row: key 0 only
                           [70, 150, 299],   # both ranges cross tile boundaries
                           [3, 100, 101],    # one key in the second range
                           [64, 64, 130],    # the ranges touch
                           [200, 250, 240]])  # an empty second range
    q = torch.randn(len(rows), heads, 1, dim, generator=generator)
    want = reference_two_range_attention(q, keys, values, rows, ranges)
    got = launch_two_range_kernel(kernel, q, keys, values, rows, ranges)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bfloat16 cache and query: float32 inside, one rounding at the end (the interpreter rounds
    # toward zero, CUDA to nearest: within one bfloat16 step of the float32 answer either way)
    got = launch_two_range_kernel(kernel, q.bfloat16(), keys.bfloat16(), values.bfloat16(),
                                  rows, ranges)
    exact = reference_two_range_attention(q.bfloat16().float(), keys.bfloat16().float(),
                                          values.bfloat16().float(), rows, ranges)
    assert got.dtype == torch.bfloat16
    step = exact.abs().clamp(min=2.0 ** -126) * 2.0 ** -7
    assert bool(((got.float() - exact).abs() <= step).all()), float((got.float() - exact).abs().max())


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["one-key-head-per-query-head", "grouped"])
def test_the_kernel_computes_what_sdpa_over_the_ranges_mask_computes(kv_heads):
    pytest.importorskip("triton")  # scripts/setup installs it with the test extra
    # a process of its own: the interpreter mode must be on before Triton is first imported
    run = subprocess.run(
        [sys.executable, "-c", "from tests.engines.minicpmo.test_range_attention import "
                               f"check_kernel_against_sdpa; check_kernel_against_sdpa({kv_heads})"],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_off_cuda_two_range_attention_is_the_reference():
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 2, 40, 8, generator=generator)
    values = torch.randn(3, 2, 40, 8, generator=generator)
    q = torch.randn(2, 2, 1, 8, generator=generator)
    rows, ranges = torch.tensor([2, 1]), torch.tensor([[5, 20, 31], [1, 0, 0]])
    visible = ranges_mask(ranges, 40)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys[rows], values[rows],
                                                             attn_mask=visible)
    torch.testing.assert_close(two_range_attention(q, keys, values, rows, ranges), want)
