"""The tiny voice-cloning golden checkpoint (``apm.*`` and ``audio_projection_layer.*`` too, and
``vpm.*``/``resampler.*`` decoys the loader skips), rebuilt by the project's own generator.

Provenance of ``expected/``: upstream MiniCPM-o 2.6 code (``modeling_minicpmo.py``,
``processing_minicpmo.py``) run in float32 on the CPU on this checkpoint, greedy; the cases:
``voice_features`` (features, both encoder attention forms, projection, pooling, placeholders),
``voice_prompt`` (upstream ``chat``'s voice-cloning prompt, its input embeddings and the hidden
state at ``<|spk|>``), ``voice_prompt_streaming`` (the same voice through the streaming API,
two prefills), ``voice_stream`` (the TTS stream in that voice: codes per call and audio).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.golden import checkpoint as golden

VOICE_DIR = Path(__file__).resolve().parent


def load_manifest() -> dict:
    return golden.load_manifest(VOICE_DIR)


def build_voice_checkpoint(out_dir: Path) -> Path:
    return golden.build_tiny_checkpoint(out_dir, VOICE_DIR)


def load_expected(case: str) -> dict[str, np.ndarray]:
    return golden.load_expected(case, VOICE_DIR)
