"""Engine names -> engine factories and their options; each engine module is imported only
when chosen.

Lazy imports keep a piper deployment free of torch and a minicpmo one free of onnxruntime; the
options modules import neither, so ``serve run`` checks ``engine_options`` when it builds the app.
"""

from __future__ import annotations

from typing import Any, Callable

from serve_app.engines.base import Engine
from serve_app.engines.minicpmo.options import EngineOptions as MiniCPMOOptions
from serve_app.engines.piper.options import PiperOptions


def _piper(options: dict[str, Any]) -> Engine:
    from serve_app.engines.piper.piper_engine import PiperEngine

    return PiperEngine.from_options(**options)


def _minicpmo(options: dict[str, Any]) -> Engine:
    from serve_app.engines.minicpmo import MiniCPMOEngine

    return MiniCPMOEngine.from_options(**options)


ENGINES: dict[str, Callable[[dict[str, Any]], Engine]] = {
    "piper": _piper,
    "minicpmo": _minicpmo,
}


# Each engine's ``engine_options`` (a pydantic dataclass; ``max_slots``: streams run at once).
ENGINE_OPTIONS: dict[str, type[MiniCPMOOptions] | type[PiperOptions]] = {
    "piper": PiperOptions,
    "minicpmo": MiniCPMOOptions,
}


def create_engine(name: str, options: dict[str, Any]) -> Engine:
    """Build the engine registered as ``name`` with ``options`` as keyword arguments."""
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None
    return factory(dict(options))
