"""The audio window's rows (``audio_window_rows``): a window whose rows are only the generating
streams, gathered by slot (padding rows pointing at the first stream's slot), makes the same
frames and leaves the same cache as the window over every slot below the highest, as the CUDA
graphs lay them out (``window_inputs``, ``gathered_slots``). On the CPU, with ``visible_ranges``
attention, the tiny checkpoint's TTS; the CUDA kernel that reads rows by slot is checked
against the layer in test_range_attention.py (a gathered, out-of-order batch with padding)."""

from __future__ import annotations

import torch

from serve_app.engines.minicpmo.device.audio_step import (
    AudioStepInputs,
    audio_window,
    gathered_slots,
    window_inputs,
)
from serve_app.engines.minicpmo.device.graphs import row_bucket_sizes
from serve_app.engines.minicpmo.model.layers import SlotKVCache, set_one_query_attention
from serve_app.engines.minicpmo.model.loader import load_speech_model

SLOTS = 8
STEPS = 5


def streams_inputs(cfg, slots: list[int]) -> AudioStepInputs:
    """Streams at different points of their calls: one starting ([Ptts]), others mid-call
    with a last frame, one whose call ends inside the window (steps_left 2)."""
    generator = torch.Generator().manual_seed(7)
    count = len(slots)
    frame = torch.randint(0, cfg.num_audio_tokens - 1, (count, cfg.num_vq), generator=generator)
    position = torch.tensor([cfg.audio_bos_position + 3 * i for i in range(count)])
    bos = (torch.arange(count) == 0).long()
    position[0] = cfg.audio_bos_position
    ones = torch.ones(count, dtype=torch.long)
    return AudioStepInputs(active=ones, bos=bos, frame=frame, position=position,
                           text_len=torch.full((count,), 20), call_frames=3 * torch.arange(count),
                           eos_after=torch.full((count,), 1 << 30), warp=1 - bos,
                           seed=torch.arange(count) + 11, counter=torch.arange(count) * 5,
                           greedy=torch.zeros(count, dtype=torch.long),
                           steps_left=torch.tensor([STEPS, STEPS, 2, STEPS][:count]))


def filled_cache(model) -> SlotKVCache:
    cfg = model.config
    cache = SlotKVCache(cfg.tts_shape(), SLOTS, 1024, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(3)
    for store in (cache.all_keys, cache.all_values):
        store.copy_(torch.randn(store.shape, generator=generator))
    return cache


@torch.inference_mode()
def test_a_window_of_the_generating_rows_makes_what_the_slot_range_makes(tiny_checkpoint):
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    set_one_query_attention(model.tts, "visible_ranges")
    cfg = model.config.tts
    slots = [6, 1, 4, 3]  # spread over the slots, out of order, as slots freed and taken again
    x = streams_inputs(cfg, slots)
    num_vq = cfg.num_vq

    # every slot below the highest: 7 rows, 3 of them padding
    range_cache = filled_cache(model)
    range_bucket = max(slots) + 1
    range_in = AudioStepInputs.unpack(window_inputs(slots, x, range_bucket, False), num_vq)
    by_range = audio_window(model.tts, range_cache, range_in, torch.arange(range_bucket), True,
                            STEPS)[:, torch.tensor(slots)]

    # the generating rows only, padded to their bucket
    gathered_cache = filled_cache(model)
    bucket = next(b for b in row_bucket_sizes(SLOTS) if b >= len(slots))
    assert bucket == 4
    padded = bucket + 2  # and with padding rows beyond them
    gathered_in = AudioStepInputs.unpack(window_inputs(slots, x, padded, True), num_vq)
    rows = gathered_slots(slots, padded)
    assert rows.tolist() == [6, 1, 4, 3, 6, 6]
    by_rows = audio_window(model.tts, gathered_cache, gathered_in, rows, False,
                           STEPS)[:, :len(slots)]

    assert torch.equal(by_rows, by_range)
    assert by_rows[:, :, -1].sum(dim=0).tolist() == [5, 5, 2, 5]  # frames made per stream
    scratch = range_cache.scratch_position
    for got, want in ((gathered_cache.all_keys, range_cache.all_keys),
                      (gathered_cache.all_values, range_cache.all_values)):
        # every position but the scratch one, of every slot: the same keys and values (to
        # float32's rounding: a matmul over 6 rows may sum in another order than over 7)
        torch.testing.assert_close(got[..., :scratch, :], want[..., :scratch, :],
                                   rtol=1e-5, atol=1e-6)


def test_row_buckets_pad_a_batch_by_less_than_a_step():
    buckets = row_bucket_sizes(1024)
    assert buckets[:8] == [1, 2, 4, 8, 16, 32, 64, 128] and buckets[-1] == 1024
    for rows in (65, 700, 769, 1000):
        assert next(b for b in buckets if b >= rows) - rows < 64
    assert row_bucket_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
