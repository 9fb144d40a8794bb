"""The tiny golden checkpoints, rebuilt from their manifests by the project's own generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from serve_app.engines.minicpmo.model.synthetic import write_checkpoint

GOLDEN_DIR = Path(__file__).resolve().parent


def load_manifest(folder: Path = GOLDEN_DIR) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def build_tiny_checkpoint(out_dir: Path, folder: Path = GOLDEN_DIR) -> Path:
    return write_checkpoint(out_dir, load_manifest(folder), folder / "tokenizer",
                            folder / "chattts_tokenizer")


def load_expected(case: str, folder: Path = GOLDEN_DIR) -> dict[str, np.ndarray]:
    with np.load(folder / "expected" / f"{case}.npz") as data:
        return {key: data[key] for key in data.files}
