"""Where and in what precision the engine's model runs: the torch side of its options
(:class:`~serve_app.engines.minicpmo.options.EngineOptions` names them; torch resolves them)."""

from __future__ import annotations

import torch

from ..options import EngineOptions

DECODE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolved_device(options: EngineOptions) -> torch.device:
    """``device``; ``auto`` is CUDA where there is one, else the CPU."""
    if options.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(options.device)


def resolved_dtype(options: EngineOptions) -> torch.dtype:
    """``dtype``; ``auto`` is bfloat16 on CUDA, else float32."""
    if options.dtype == "auto":
        return torch.bfloat16 if resolved_device(options).type == "cuda" else torch.float32
    return MODEL_DTYPES[options.dtype]
