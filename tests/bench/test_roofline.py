"""The roofline arithmetic of bench/engine/roofline.py and bench/engine/project_gpu.py, on the real
engine's counted work (tiny checkpoint, CPU) and on the full-size shapes (meta device)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.engine.project_gpu import full_size_sizes, solve_streams
from bench.engine.roofline import GPUS, PHASE_WORK, ModelSizes, phase_bytes, phase_flops, project, roofline
from serve_app.engines.base import LengthControls, SpeechRequest
from tests.engines.minicpmo.tiny_engine import tiny_engine

ROOT_TOKENIZER = Path(__file__).resolve().parents[1] / "golden" / "chattts_tokenizer"


@pytest.fixture(scope="module")
def counted(tiny_checkpoint):
    """One read and one chat stream through the tiny engine: its model and the work counted."""
    engine = tiny_engine(tiny_checkpoint, max_slots=4, max_chat_slots=2)
    try:
        before = engine.device_work()

        async def run() -> None:
            streams = engine.submit([
                SpeechRequest("read-roof", "Reading for the roofline.",
                              lengths=LengthControls(audio_frames=30)),
                SpeechRequest("chat-roof", "Say something.", mode="chat",
                              lengths=LengthControls(audio_frames=30))])
            for stream in streams:
                async for _ in stream:
                    pass

        asyncio.run(run())
        work = {k: v - before.get(k, 0) for k, v in engine.device_work().items()}
        return ModelSizes.of(engine.model), work
    finally:
        engine.close()


def test_every_phase_with_work_has_bytes_and_flops(counted) -> None:
    sizes, work = counted
    moved, flops = phase_bytes(sizes, work), phase_flops(sizes, work)
    assert set(moved) == set(flops) == set(PHASE_WORK)
    for phase in PHASE_WORK:
        assert moved[phase] > 0 and flops[phase] > 0, phase
    table = roofline(sizes, work, steps=1, phase_ms={"tts_step": 0.01}, busy_ms_per_step=0.05,
                     gpu=GPUS["a10g"])
    step = table["phases"]["tts_step"]
    # the least time on the GPU, and the measured time's distance to it
    floor_ms = max(moved["tts_step"] / GPUS["a10g"].bandwidth,
                   flops["tts_step"] / GPUS["a10g"].bf16_flops) * 1000
    assert step["roofline_ms"] == pytest.approx(floor_ms, abs=1e-3)
    assert step["of_roofline"] == pytest.approx(floor_ms / 0.01, rel=0.01)
    assert "roofline_ms" not in table["phases"]["llm_decode"]  # no time measured for it


def test_projecting_onto_the_same_gpu_changes_nothing_and_int4_only_moves_the_llm(counted) -> None:
    sizes, work = counted
    phase_ms = {"admit_prefill": 1.0, "llm_decode": 2.0, "tts_prefill": 0.5, "tts_step": 3.0,
                "decode_emit": 0.7, "schedule": 0.2}
    same = project(work, phase_ms, sizes, GPUS["h100"], sizes, GPUS["h100"])
    assert same["projected_ms_per_step"] == pytest.approx(sum(phase_ms.values()), abs=0.01)
    int4 = sizes.with_int4_llm()
    assert int4.llm_weight_bytes < sizes.llm_weight_bytes and int4.with_int4_llm() == int4
    moved = project(work, phase_ms, sizes, GPUS["h100"], int4, GPUS["h100"])["phases"]
    assert moved["llm_decode"]["projected_ms"] < phase_ms["llm_decode"]
    for phase in ("tts_prefill", "tts_step", "decode_emit"):
        assert moved[phase]["projected_ms"] == pytest.approx(phase_ms[phase], abs=1e-3)
    slower = project(work, phase_ms, sizes, GPUS["h100"], sizes, GPUS["a10g"])
    assert slower["projected_ms_per_step"] > same["projected_ms_per_step"]


def test_full_size_int4_weights_are_about_a_third_of_bf16() -> None:
    sizes = full_size_sizes(ROOT_TOKENIZER)
    assert sizes.llm_matmul_params == 6_525_288_448  # Qwen2-7B's decoder linears
    ratio = sizes.with_int4_llm().llm_weight_bytes / sizes.llm_weight_bytes
    assert 0.25 < ratio < 0.4  # lm_head stays bf16


def test_stream_count_at_a_limit_interpolates_or_extrapolates_linearly() -> None:
    assert solve_streams([(64, 50.0), (128, 100.0), (256, 200.0)], 150.0) == pytest.approx(192)
    assert solve_streams([(128, 124.7), (256, 265.7)], 106.7) == pytest.approx(111.66, abs=0.01)
    assert solve_streams([(32, 10.0), (64, 20.0)], 40.0) == pytest.approx(128)
    assert solve_streams([(32, 10.0)], 40.0) is None
