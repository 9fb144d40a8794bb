"""The model's choices by name, free of torch: what the engine's options
(:mod:`~serve_app.engines.minicpmo.options`) check at ``serve run`` before any replica starts.
The modules that act on them (loader, layers, quantization) import them from here."""

from __future__ import annotations

DEFAULT_MODEL_ID = "openbmb/MiniCPM-o-2_6"
# decode-step attention of the TTS (layers.set_one_query_attention)
ONE_QUERY_KERNELS = ("sdpa", "matmul", "flex", "visible_ranges")
# the LLM linears (quantization.py)
QUANTIZATION_MODES = ("none", "int8", "int4", "int4-tinygemm")
# DVAE + Vocos weights and activations (the engine maps them to torch dtypes)
DECODE_DTYPE_NAMES = ("float32", "bfloat16")
# how a slot cache stores keys and values (kv_cache.py), named as vLLM names its kv_cache_dtype:
# "auto" in the model's dtype, "fp8_e4m3" as e4m3 numbers with a float32 scale per key and value
# vector
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
# weights and activations of the LLM and the TTS; "auto": bfloat16 on CUDA, else float32
MODEL_DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")


def check_quantization(mode: str) -> str:
    """``mode`` if it is one of :data:`QUANTIZATION_MODES`, else :class:`ValueError`."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    return mode
