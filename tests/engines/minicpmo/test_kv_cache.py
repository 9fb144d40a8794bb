"""The slot cache in fp8 (``tts_kv_cache_dtype: fp8_e4m3``): what it stores, what it reads back,
and the engine speaking through it on the tiny golden checkpoint."""

from __future__ import annotations

import asyncio

import pytest
import torch

from serve_app.engines.base import SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.kv_cache import FP8_MAX, fp8_dequantize, fp8_quantize
from serve_app.engines.minicpmo.model.layers import (
    DecoderShape,
    SlotDecoder,
    SlotKVCache,
    StepInputs,
    causal_attend,
)
from serve_app.engines.minicpmo.model.loader import load_speech_model

SHAPE = DecoderShape(hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=False)


def test_fp8_keeps_each_number_within_one_e4m3_step_of_its_vectors_scale():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(500, 3, 64, generator=generator) * torch.logspace(-4, 3, 500)[:, None, None]
    x[7] = 0.0  # an all-zero vector stays zero
    numbers, scale = fp8_quantize(x)
    assert numbers.dtype == torch.float8_e4m3fn and scale.shape == (500, 3)
    assert float(numbers.float().abs().amax()) == FP8_MAX  # each vector's largest uses the range
    back = fp8_dequantize(numbers, scale, torch.float32)
    assert torch.equal(back[7], torch.zeros(3, 64))
    # e4m3 keeps 3 mantissa bits: a relative error of at most 1/16, and below 2**-6 of the
    # range (subnormals) an absolute one of half a step (2**-10 of the scale)
    bound = torch.maximum(x.abs() / 16, scale[..., None] * 2.0 ** -10)
    assert bool(((back - x).abs() <= bound * 1.0001).all())


def test_a_decoder_over_an_fp8_cache_reads_back_what_it_wrote_to_fp8_precision():
    """The same prefill and decode step over a float32 cache and an fp8 one: the fp8 cache
    holds the float32 cache's keys to fp8 precision, a cleared slot is zero, and the step's
    output stays close, while the fp8 cache holds half or less of the bytes per slot."""
    torch.manual_seed(1)
    decoder = SlotDecoder(SHAPE).eval()
    exact = SlotKVCache(SHAPE, 3, 40, torch.device("cpu"), torch.float32)
    small = SlotKVCache(SHAPE, 3, 40, torch.device("cpu"), torch.float32, "fp8_e4m3")
    assert small.quantized and not exact.quantized
    assert small.bytes_per_slot < exact.bytes_per_slot / 3  # 1 byte + 4/64 against 4 bytes
    hidden = torch.randn(3, 12, 64)
    positions = torch.arange(12)[None].expand(3, 12)
    valid = torch.ones(3, 12, dtype=torch.bool)
    prefill = StepInputs(torch.arange(3), positions, positions, causal_attend(positions, valid, 41))
    with torch.inference_mode():
        outputs = [decoder(hidden, cache, prefill) for cache in (exact, small)]
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0.1, atol=0.1)
        # the first layer's inputs are the same in both, so are the keys it wrote, to fp8's
        # precision (the later layers' inputs already differ by it)
        for want, got in zip(exact.layers[0].read(slice(None), 12), small.layers[0].read(slice(None), 12)):
            torch.testing.assert_close(got, want, rtol=1 / 16, atol=1e-3)
        at = torch.full((3, 1), 12)
        step = StepInputs(torch.tensor([2, 0, 1]), at, at, causal_attend(at, valid[:, :1], 41))
        one = [decoder(torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(2)), cache, step)
               for cache in (exact, small)]
        torch.testing.assert_close(one[1], one[0], rtol=0.1, atol=0.1)
    small.clear_slot(1, upto=5)
    keys, values = small.layers[0].read(slice(1, 2), 13)
    assert not keys[..., :5, :].any() and keys[..., 5:, :].any()
    assert small.all_key_scales[:, 1, :, :5].eq(0).all()
    with pytest.raises(NotImplementedError):  # prefix copies are the LLM's, in its own dtype
        small.read_prefix(0, 4)
    with pytest.raises(ValueError, match="kv_dtype"):
        SlotKVCache(SHAPE, 1, 8, torch.device("cpu"), torch.float32, "fp8")


def test_the_option_is_checked_when_the_config_is():
    assert EngineOptions(tts_kv_cache_dtype="fp8_e4m3").tts_kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="tts_kv_cache_dtype"):
        EngineOptions(tts_kv_cache_dtype="fp8")


async def _speak(engine: MiniCPMOEngine, text: str) -> tuple[int, list[list[int]]]:
    request = SpeechRequest(request_id="fp8", text=text, mode="read")
    (stream,) = engine.submit_plans([engine.plan(request)])
    samples = 0
    async for chunk in stream:
        samples += len(chunk.samples)
    return samples, [frame for segment in engine.trace("fp8").finished_segments
                     for frame in segment]


def test_the_engine_speaks_through_an_fp8_tts_cache(tiny_checkpoint):
    """The real engine on the tiny checkpoint with the TTS cache in fp8 streams a whole
    utterance of valid codes through it (the cache holds e4m3 numbers and the scales it
    wrote). How far its codes drift from the float32 cache's is measured, not asserted:
    bench/accuracy/kv_cache.py, docs/benchmarks/kv-fp8-numerics.json."""
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                            admission="slots", max_slots=2, max_chat_slots=1, tts_max_positions=1024,
                            llm_max_positions=256, tts_sampling="greedy", keep_traces=True,
                            tts_kv_cache_dtype="fp8_e4m3", one_query_attention="visible_ranges")
    engine = MiniCPMOEngine(model, options)
    try:
        cache = engine._runner.tts_cache
        assert cache.all_keys.dtype == torch.float8_e4m3fn
        samples, frames = asyncio.run(_speak(engine, "Hello there, how are you?"))
    finally:
        engine.close()
    assert len(frames) >= 10 and samples >= len(frames) * 512 * 0.9
    num_codes = model.config.tts.num_audio_tokens
    assert all(len(frame) == 4 and all(0 <= c < num_codes for c in frame) for frame in frames)
    written = cache.all_key_scales.gt(0).any(dim=(0, 2))  # [slots, positions]
    audio_at = model.config.tts.audio_bos_position
    assert int(written[:, audio_at:].sum()) >= len(frames)  # each frame's key, with its scale


def test_the_drift_benchmark_runs_on_the_tiny_checkpoint(tmp_path):
    """bench/accuracy/kv_cache.py end to end on the tiny checkpoint: both caches stepped over
    the same streams, the reference's own dtype through SDPA as its floor (on the CPU the fused
    path is SDPA too, so the floor agrees exactly), and its runs kept per weights in one file."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "numerics.json"
    out.write_text(json.dumps({"runs": {"random": {"kept": True}}}))
    subprocess.run([sys.executable, "-m", "bench.accuracy.kv_cache", "--weights", "tiny",
                    "--device", "cpu", "--streams", "2", "--steps", "12", "--out", str(out)],
                   cwd=Path(__file__).resolve().parents[3], check=True, capture_output=True,
                   timeout=600)
    runs = json.loads(out.read_text())["runs"]
    assert runs["random"] == {"kept": True}
    tiny = runs["tiny"]
    assert (tiny["streams"], tiny["steps"]) == (2, 12)
    assert 0.0 <= tiny["teacher_forced"]["top1_agreement"] <= 1.0
    assert tiny["teacher_forced"]["kl_nats_temperature_1"]["max"] >= 0.0
    assert tiny["floor_teacher_forced"]["top1_agreement"] == 1.0
    assert tiny["floor_teacher_forced"]["kl_nats_sampling_temperature"]["max"] == 0.0
    assert 0 <= tiny["free_running_greedy"]["first_different_frame"]["p50"] <= 12


def test_a_tts_cache_too_short_for_the_text_condition_is_refused_at_start(tiny_checkpoint):
    """A slot of fewer positions than the TTS's text condition and one call would fail the
    whole step that reaches past it (every stream in it); the engine refuses to start instead."""
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"tts_max_positions \(256\) must hold"):
        MiniCPMOEngine(model, EngineOptions(model=str(tiny_checkpoint), device="cpu",
                                            dtype="float32", tts_max_positions=256))
