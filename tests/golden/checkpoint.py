"""The tiny golden checkpoint, rebuilt from the manifest by the project's own generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from serve_app.engines.minicpmo.synthetic import write_checkpoint

GOLDEN_DIR = Path(__file__).resolve().parent


def load_manifest() -> dict:
    return json.loads((GOLDEN_DIR / "manifest.json").read_text())


def build_tiny_checkpoint(out_dir: Path) -> Path:
    return write_checkpoint(out_dir, load_manifest(), GOLDEN_DIR / "tokenizer",
                            GOLDEN_DIR / "chattts_tokenizer")


def load_expected(case: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN_DIR / "expected" / f"{case}.npz") as data:
        return {key: data[key] for key in data.files}
