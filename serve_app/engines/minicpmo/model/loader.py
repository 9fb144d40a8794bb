"""Load the official MiniCPM-o 2.6 checkpoint layout (Hub id or local folder).

Only the speech path is read: ``llm.*`` and ``tts.*`` minus the DVAE encoder and the TTS's
unused ``embed_tokens``, and for voice cloning (``audio_encoder=True``) the audio-in path
``apm.*`` and ``audio_projection_layer.*``; the vision side (``vpm.*``, ``resampler.*``) is
never materialised. Modules are built on the meta device and each tensor goes straight
from the safetensors file to the target device and dtype, so there is no second full copy in
host memory.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from .audio_in import ClipEncoder
from .codec import SpeechDecoder
from .gptq import GPTQ_PARTS, GPTQConfig, dequantize_gptq_linear, gptq_int4_weight
from .modeling import ModelConfig, QwenLM, SpeechTokenModel
from .names import DEFAULT_MODEL_ID
from .quantization import Int4Weight, quantize_decoder_layer, resolve_mode

logger = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("vpm.", "resampler.")
AUDIO_IN_PREFIXES = ("apm.", "audio_projection_layer.")
# Files the speech path needs from a Hub snapshot (vision code and assets are skipped).
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
    clip_encoder: ClipEncoder | None = None  # the audio-in path, for voice cloning


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


def checkpoint_keys(path: Path) -> set[str]:
    """Every tensor key of the checkpoint (headers only; no tensor is read)."""
    keys: set[str] = set()
    for shard in _shard_files(path):
        with safe_open(str(shard), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def iter_tensors(path: Path, wanted: Callable[[str], bool], device: torch.device,
                 dtype: torch.dtype, keep_dtype: Callable[[str], bool] = lambda key: False,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` for wanted keys, each read straight onto ``device``; floating
    tensors in ``dtype`` unless ``keep_dtype(key)``."""
    load_device = "cpu" if device.type == "meta" else str(device)
    for shard in _shard_files(path):
        with safe_open(str(shard), framework="pt", device=load_device) as handle:
            for key in handle.keys():
                if key.startswith(SKIPPED_PREFIXES) or not wanted(key):
                    continue
                tensor = handle.get_tensor(key)
                if tensor.is_floating_point() and not keep_dtype(key):
                    tensor = tensor.to(dtype)
                yield key, tensor


def _llm_key(key: str) -> bool:
    return key.startswith("llm.")


def _tts_key(key: str) -> bool:
    return (key.startswith("tts.") and not key.startswith("tts.dvae.")
            and not key.startswith("tts.model.embed_tokens."))


def _audio_in_key(key: str) -> bool:
    return key.startswith(AUDIO_IN_PREFIXES)


def fold_weight_norm(magnitude: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Weight-norm parametrisation (dim 0) folded into a plain weight."""
    return torch._weight_norm(direction, magnitude, 0)


def _assign(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{what}: checkpoint does not match (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")


class _LayerwiseAssigner:
    """Assigns a meta-built ``QwenLM``'s tensors, one decoder layer as soon as all of its
    tensors have arrived, and hands that layer to ``finish_layer(index, layer)`` (quantization)
    at once, so at most the layers still being read sit on the device in the compute dtype."""

    _LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")

    def __init__(self, llm: QwenLM, finish_layer: Callable[[int, nn.Module], object]) -> None:
        self.llm = llm
        self.finish_layer = finish_layer
        self.expected = [set(layer.state_dict()) for layer in llm.model.layers]
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.rest: dict[str, torch.Tensor] = {}
        self.done: set[int] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        match = self._LAYER_KEY.fullmatch(name)
        if match is None:
            self.rest[name] = tensor
            return
        index, sub = int(match[1]), match[2]
        if index >= len(self.expected) or sub not in self.expected[index] or index in self.done:
            raise ValueError(f"llm: checkpoint does not match (unexpected {name})")
        bucket = self.pending.setdefault(index, {})
        bucket[sub] = tensor
        if len(bucket) == len(self.expected[index]):
            layer = self.llm.model.layers[index]
            _assign(layer, self.pending.pop(index), f"llm layer {index}")
            self.finish_layer(index, layer)
            self.done.add(index)

    def finish(self) -> None:
        missing = [f"model.layers.{i}.{k}" for i, b in sorted(self.pending.items())
                   for k in sorted(self.expected[i] - set(b))]
        missing += [f"model.layers.{i}.*" for i in range(len(self.expected))
                    if i not in self.done and i not in self.pending]
        if missing:
            raise ValueError(f"llm: checkpoint does not match (missing {missing[:5]})")
        rest_missing, unexpected = self.llm.load_state_dict(self.rest, strict=False, assign=True)
        rest_missing = [k for k in rest_missing if not k.startswith("model.layers.")]
        if rest_missing or unexpected:
            raise ValueError(f"llm: checkpoint does not match (missing {rest_missing[:5]}, "
                             f"unexpected {unexpected[:5]})")
        self.rest = {}


def load_llm(path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
             mode: str = "none") -> QwenLM:
    """The LLM from ``llm.*``: dense weights, or GPTQ int4 linears; then, layer by layer,
    quantized as the effective quantization ``mode`` asks (:func:`.quantization.resolve_mode`).

    GPTQ linears go to the int4 kernel as they are stored under ``int4`` when their groups
    allow it; otherwise they are dequantized to ``dtype`` first."""
    gptq = GPTQConfig.from_checkpoint(path)
    with torch.device("meta"):
        llm = QwenLM(config.llm, config.vocab_size)
    int4_weights: dict[int, dict[str, Int4Weight]] = {}  # layer -> linear name -> weight

    def finish_layer(index: int, layer: nn.Module) -> None:
        quantize_decoder_layer(layer, mode, dtype, int4_weights.pop(index, None))

    assigner = _LayerwiseAssigner(llm, finish_layer)
    if gptq is None:
        for key, tensor in iter_tensors(path, _llm_key, device, dtype):
            assigner.add(key[len("llm."):], tensor)
        assigner.finish()
        return llm

    keys = checkpoint_keys(path)
    is_gptq_part = lambda key: key.rpartition(".")[2] in GPTQ_PARTS  # noqa: E731
    expected_parts = {}
    for key in keys:
        if _llm_key(key) and is_gptq_part(key):
            module, _, part = key[len("llm."):].rpartition(".")
            expected_parts.setdefault(module, set()).add(part)
    collected: dict[str, dict[str, torch.Tensor]] = {}
    direct = 0
    for key, tensor in iter_tensors(path, _llm_key, device, dtype, keep_dtype=is_gptq_part):
        module, _, part = key[len("llm."):].rpartition(".")
        if part not in GPTQ_PARTS:
            assigner.add(key[len("llm."):], tensor)
            continue
        parts = collected.setdefault(module, {})
        parts[part] = tensor
        if set(parts) != expected_parts[module]:
            continue
        del collected[module]
        weight = gptq_int4_weight(parts, gptq) if mode == "int4" else None
        layer = _LayerwiseAssigner._LAYER_KEY.fullmatch(module)
        if weight is None or layer is None:
            assigner.add(f"{module}.weight", dequantize_gptq_linear(parts, gptq, dtype))
            continue
        direct += 1
        int4_weights.setdefault(int(layer[1]), {})[layer[2]] = weight
        # the kernel takes the codes; the linear itself only needs its shape until then
        assigner.add(f"{module}.weight", torch.empty(weight.shape, dtype=dtype, device="meta"))
    if collected:
        raise ValueError(f"llm: incomplete GPTQ linears {sorted(collected)[:5]}")
    assigner.finish()
    logger.info("GPTQ checkpoint (%s): %d linears into the int4 kernel as stored, %d dequantized "
                "to %s%s", gptq, direct, len(expected_parts) - direct, dtype,
                f" (then quantized: {mode})" if mode != "none" else "")
    return llm


def load_clip_encoder(path: Path, config: ModelConfig, device: torch.device,
                      dtype: torch.dtype) -> ClipEncoder:
    """The audio-in path (``apm.*``, ``audio_projection_layer.*``; config ``audio_config``,
    ``audio_pool_step``, ``audio_chunk_length``)."""
    if config.audio is None:
        raise ValueError(f"{path}: config.json has no audio_config, so no audio encoder for "
                         "voice cloning (turn engine_options.voices off)")
    with torch.device("meta"):
        encoder = ClipEncoder(config.audio, config.llm.hidden_size)
    _assign(encoder, dict(iter_tensors(path, _audio_in_key, device, dtype)), "audio encoder")
    return encoder.eval()


def load_speech_model(model: str = DEFAULT_MODEL_ID, revision: str | None = None,
                      device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      codec_dtype: torch.dtype = torch.float32,
                      quantization: str = "none", audio_encoder: bool | None = False) -> LoadedModel:
    """Load LLM, TTS, DVAE decoder, Vocos and both tokenizers from the official layout, and
    with ``audio_encoder`` the audio-in path voice cloning needs (None: if the checkpoint's
    config has one; True: it must).

    The checkpoint may be the bf16 one or the GPTQ int4 one (``openbmb/MiniCPM-o-2_6-int4``);
    ``quantization`` (``none | int8 | int4 | int4-tinygemm``) applies to the LLM's decoder linears.
    """
    device = torch.device(device)
    mode = resolve_mode(quantization, device)  # a missing library fails before any download
    path = resolve_checkpoint(model, revision)
    config = ModelConfig.from_file(path / "config.json")
    llm = load_llm(path, config, device, dtype, mode)
    with torch.device("meta"):
        tts = SpeechTokenModel(config.tts, config.tts_shape())

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
    if audio_encoder is None:
        audio_encoder = config.audio is not None
    clip_encoder = load_clip_encoder(path, config, device, dtype) if audio_encoder else None
    return LoadedModel(config, llm, tts, decoder, tokenizer, tts_tokenizer, path, clip_encoder)


def load_llm_tokenizer(path: Path):
    """The LLM tokenizer without running remote code (the fast tokenizer file suffices)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (ValueError, OSError, KeyError) as error:
        logger.info("AutoTokenizer failed (%s); using tokenizer.json directly", error)
        return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
