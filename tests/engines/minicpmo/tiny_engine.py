"""The real engine on the tiny golden checkpoint, on the CPU, greedy, keeping its traces.

The suite's engines admit by slots: on a CPU shared with other work the tiny model is not
real-time, and admission by work would refuse streams these tests need (admission by work has
its own tests: tests/engines/test_work_admission*.py, tests/serving/test_overload.py)."""

from __future__ import annotations

import torch

from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.loader import load_speech_model


def tiny_engine(checkpoint, max_slots: int, max_chat_slots: int) -> MiniCPMOEngine:
    model = load_speech_model(str(checkpoint), device="cpu", dtype=torch.float32)
    options = EngineOptions(model=str(checkpoint), device="cpu", dtype="float32",
                            admission="slots", max_slots=max_slots, max_chat_slots=max_chat_slots,
                            tts_max_positions=1024, llm_max_positions=256,
                            tts_sampling="greedy", keep_traces=True)
    return MiniCPMOEngine(model, options)


def module_engine(max_slots: int, max_chat_slots: int):
    """A module-scoped pytest fixture: :func:`tiny_engine` on the session's tiny checkpoint,
    closed after the module."""
    import pytest

    @pytest.fixture(scope="module")
    def engine(tiny_checkpoint):
        engine = tiny_engine(tiny_checkpoint, max_slots=max_slots, max_chat_slots=max_chat_slots)
        yield engine
        engine.close()

    return engine
