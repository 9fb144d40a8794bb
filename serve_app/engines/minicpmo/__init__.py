"""Native batched MiniCPM-o 2.6 speech engine (no Ray import).

The engine (torch) loads on first use, so that ``serve_app.engines.minicpmo.options`` is
importable where torch is not (``serve run`` checks the options when it builds the app)."""

from __future__ import annotations

from typing import Any

from .options import EngineOptions

__all__ = ["EngineOptions", "MiniCPMOEngine", "StreamPlan"]


def __getattr__(name: str) -> Any:
    if name in ("MiniCPMOEngine", "StreamPlan"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
