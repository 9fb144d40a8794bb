"""Checkpoints in the official MiniCPM-o 2.6 layout filled with deterministic synthetic weights.

Used by the tests (the tiny golden checkpoint) and by benchmarks (full-size random weights), so
both exercise the production loader on the real file layout. Every tensor comes from a fixed
recipe: parameter ``name`` is drawn as uniform(-1, 1) from a CPU ``torch.Generator`` seeded with
``crc32(name)`` and shaped by its init rule, so any machine rebuilds the same bytes.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

INIT_RULES = ("linear", "embed", "gain", "positive", "small", "hann", "zeros")


def synthetic_tensor(name: str, shape: list[int], init: str) -> torch.Tensor:
    """The recipe's tensor for parameter ``name`` (float32, CPU)."""
    if init == "hann":
        return torch.hann_window(shape[0])
    if init == "zeros":
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    uniform = torch.rand(shape, generator=generator) * 2 - 1
    if init == "linear":
        fan_in = 1
        for dim in shape[1:]:
            fan_in *= dim
        return uniform * fan_in ** -0.5
    if init == "embed":
        return uniform * 0.5
    if init == "gain":
        return 1 + 0.1 * uniform
    if init == "positive":
        return 0.5 + 0.25 * uniform
    if init == "small":
        return 0.1 * uniform
    raise ValueError(f"unknown init rule {init!r} for {name}")


def _materialise(specs: Iterable[dict]) -> dict[str, torch.Tensor]:
    return {spec["name"]: synthetic_tensor(spec["name"], spec["shape"], spec["init"]) for spec in specs}


def write_checkpoint(out_dir: str | Path, manifest: dict, tokenizer_dir: str | Path,
                     tts_tokenizer_dir: str | Path) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``assets/Vocos.pt`` and the tokenizers.

    ``manifest`` holds ``config``, ``model_tensors`` and ``vocos_tensors`` (each a list of
    ``{"name", "shape", "init"}``), as in the golden manifest.
    """
    out = Path(out_dir)
    (out / "assets").mkdir(parents=True, exist_ok=True)
    save_file(_materialise(manifest["model_tensors"]), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    torch.save(_materialise(manifest["vocos_tensors"]), out / "assets" / "Vocos.pt")
    (out / "config.json").write_text(json.dumps(manifest["config"], indent=2))
    for item in Path(tokenizer_dir).iterdir():
        shutil.copy(item, out / item.name)
    shutil.copytree(tts_tokenizer_dir, out / "assets" / "chattts_tokenizer", dirs_exist_ok=True)
    return out
