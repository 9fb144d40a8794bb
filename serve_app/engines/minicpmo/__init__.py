"""Native batched MiniCPM-o 2.6 speech engine (no Ray import)."""

from .engine import EngineOptions, MiniCPMOEngine, StreamPlan

__all__ = ["EngineOptions", "MiniCPMOEngine", "StreamPlan"]
