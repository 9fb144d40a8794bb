"""Load the official MiniCPM-o 2.6 checkpoint layout (Hub id or local folder).

Only the speech path is read: ``llm.*`` and ``tts.*`` minus the DVAE encoder and the TTS's
unused ``embed_tokens``; ``vpm.*``, ``apm.*``, ``resampler.*`` and ``audio_projection_layer.*``
are never materialised. Modules are built on the meta device and each tensor goes straight
from the safetensors file to the target device and dtype, so there is no second full copy in
host memory.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from .codec import SpeechDecoder
from .modeling import ModelConfig, QwenLM, SpeechTokenModel

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "openbmb/MiniCPM-o-2_6"
SKIPPED_PREFIXES = ("vpm.", "apm.", "resampler.", "audio_projection_layer.")
# Files the speech path needs from a Hub snapshot (vision/audio-in code and assets are skipped).
HUB_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "vocab.json", "merges.txt", "added_tokens.json",
                "assets/Vocos.pt", "assets/chattts_tokenizer/*"]


@dataclass
class LoadedModel:
    config: ModelConfig
    llm: QwenLM
    tts: SpeechTokenModel
    decoder: SpeechDecoder
    tokenizer: object
    tts_tokenizer: object
    path: Path


def resolve_checkpoint(model: str, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hub id downloaded (HF_TOKEN / HF_HOME honoured)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    logger.info("downloading %s (revision %s) from the Hub", model, revision or "main")
    return Path(snapshot_download(repo_id=model, revision=revision, allow_patterns=HUB_PATTERNS,
                                  token=os.environ.get("HF_TOKEN")))


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({path / name for name in weight_map.values()})
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    return shards


def iter_tensors(path: Path, wanted: Callable[[str], bool], device: torch.device,
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` for wanted keys, each read straight onto ``device`` in ``dtype``."""
    load_device = "cpu" if device.type == "meta" else str(device)
    for shard in _shard_files(path):
        with safe_open(str(shard), framework="pt", device=load_device) as handle:
            for key in handle.keys():
                if key.startswith(SKIPPED_PREFIXES) or not wanted(key):
                    continue
                tensor = handle.get_tensor(key)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                yield key, tensor


def _llm_key(key: str) -> bool:
    return key.startswith("llm.")


def _tts_key(key: str) -> bool:
    return (key.startswith("tts.") and not key.startswith("tts.dvae.")
            and not key.startswith("tts.model.embed_tokens."))


def fold_weight_norm(magnitude: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Weight-norm parametrisation (dim 0) folded into a plain weight."""
    return torch._weight_norm(direction, magnitude, 0)


def _assign(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{what}: checkpoint does not match (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")


def load_speech_model(model: str = DEFAULT_MODEL_ID, revision: str | None = None,
                      device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      codec_dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load LLM, TTS, DVAE decoder, Vocos and both tokenizers from the official layout."""
    device = torch.device(device)
    path = resolve_checkpoint(model, revision)
    config = ModelConfig.from_file(path / "config.json")
    with torch.device("meta"):
        llm = QwenLM(config.llm, config.vocab_size)
        tts = SpeechTokenModel(config.tts, config.tts_shape())

    llm_state = {key[len("llm."):]: t for key, t in iter_tensors(path, _llm_key, device, dtype)}
    _assign(llm, llm_state, "llm")
    del llm_state

    tts_raw = {key[len("tts."):]: t for key, t in iter_tensors(path, _tts_key, device, dtype)}
    heads = []
    for index in range(config.tts.num_vq):
        prefix = f"head_code.{index}.parametrizations.weight."
        heads.append(fold_weight_norm(tts_raw.pop(prefix + "original0").float(),
                                      tts_raw.pop(prefix + "original1").float()).to(dtype))
    tts_raw["head_code.weight"] = torch.cat(heads, dim=0)
    _assign(tts, tts_raw, "tts")
    del tts_raw

    decoder = SpeechDecoder.from_checkpoint(path, device=device, dtype=codec_dtype)
    llm.eval()
    tts.eval()
    tokenizer = load_llm_tokenizer(path)
    from transformers import BertTokenizerFast

    tts_tokenizer = BertTokenizerFast.from_pretrained(str(path / "assets" / "chattts_tokenizer"))
    return LoadedModel(config, llm, tts, decoder, tokenizer, tts_tokenizer, path)


def load_llm_tokenizer(path: Path):
    """The LLM tokenizer without running remote code (the fast tokenizer file suffices)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (ValueError, OSError, KeyError) as error:
        logger.info("AutoTokenizer failed (%s); using tokenizer.json directly", error)
        return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
