"""Engine names -> engine factories; each engine module is imported only when chosen.

Lazy imports keep a piper deployment free of torch and a minicpmo one free of onnxruntime.
"""

from __future__ import annotations

from typing import Any, Callable

from serve_app.engines.base import Engine


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


def create_engine(name: str, options: dict[str, Any]) -> Engine:
    """Build the engine registered as ``name`` with ``options`` as keyword arguments."""
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None
    return factory(dict(options))
