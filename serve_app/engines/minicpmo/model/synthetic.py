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

import numpy as np
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


# ---- full-size random weights for benchmarks ------------------------------------------------

REAL_LLM_CONFIG = dict(vocab_size=151700, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       rope_theta=1e6, rms_norm_eps=1e-6)
REAL_TTS_CONFIG = dict(llm_dim=3584, hidden_size=768, intermediate_size=3072,
                       num_attention_heads=12, num_hidden_layers=20, num_audio_tokens=626,
                       num_text_tokens=21178, num_vq=4, num_spk_embs=1,
                       streaming_text_chunk_size=10, streaming_text_reserved_len=300,
                       streaming_audio_chunk_size=50, top_p=0.7, top_k=20, repetition_penalty=1.0)
# Whisper-medium's encoder, as the real checkpoint's ``audio_config`` has it
REAL_AUDIO_CONFIG = dict(audio_config=dict(model_type="whisper", d_model=1024, encoder_layers=24,
                                           encoder_attention_heads=16, encoder_ffn_dim=4096,
                                           num_mel_bins=80, max_source_positions=1500,
                                           activation_function="gelu"),
                         audio_pool_step=2, audio_chunk_length=1.0)
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|spk_bos|>", "<|spk|>",
                  "<|spk_eos|>", "<|tts_bos|>", "<|tts_eos|>", "<unk>", "<|audio_start|>",
                  "<|audio_end|>")


def word_level_tokenizer(vocab_size: int):
    """A tokenizer covering ``vocab_size`` ids (``w<i>`` words plus the MiniCPM-o specials).

    Benchmarks with random weights sample ids across the whole real vocabulary; this tokenizer
    decodes every one of them to a word, so the text path downstream does real work.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for index in range(len(vocab), vocab_size):
        vocab[f"w{index}"] = index
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def random_speech_model(tts_tokenizer_dir: str | Path, device: str | torch.device = "cuda",
                        dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                        clip_encoder: bool = False, quantization: str = "none"):
    """The real config's shapes with random weights, built straight on ``device`` in ``dtype``.

    TTS special ids follow ``tts_tokenizer_dir`` (the golden ChatTTS tokenizer) so its text
    layout is valid; everything else is the official size. ``clip_encoder``: the audio-in
    path too (Whisper-medium encoder and projection, for voice cloning). ``quantization``
    (an effective mode, see quantization.py) is applied to each LLM decoder layer as soon as
    it is built, so the whole bf16 LLM never sits on the device at once.
    """
    from transformers import BertTokenizerFast

    from .audio_in import ClipEncoder
    from .codec import SpeechDecoder
    from .loader import LoadedModel
    from .modeling import ModelConfig, QwenLM, SpeechTokenModel
    from .quantization import quantize_decoder_layer

    tts_tokenizer = BertTokenizerFast.from_pretrained(str(tts_tokenizer_dir))
    tts = dict(REAL_TTS_CONFIG, spk_emb_token_id=tts_tokenizer.convert_tokens_to_ids("[spk_emb]"),
               audio_bos_token_id=tts_tokenizer.convert_tokens_to_ids("[Ptts]"),
               text_eos_token_id=tts_tokenizer.convert_tokens_to_ids("[Etts]"))
    config = ModelConfig.from_dict(dict(REAL_LLM_CONFIG, tts_config=tts, **REAL_AUDIO_CONFIG))
    device = torch.device(device)
    torch.manual_seed(seed)
    with torch.device("meta"):
        llm = QwenLM(config.llm, config.vocab_size)
        tts_model = SpeechTokenModel(config.tts, config.tts_shape())
        audio = ClipEncoder(config.audio, config.llm.hidden_size) if clip_encoder else None

    def fill_random(module: torch.nn.Module, prefix: str = "") -> None:
        module.to(dtype).to_empty(device=device)
        for name, param in module.named_parameters(prefix=prefix):
            if name.endswith("norm.weight") or "layernorm" in name:
                param.data.fill_(1.0)
            elif name.endswith("bias"):
                param.data.zero_()
            else:
                param.data.normal_(0.0, 0.02)

    for index, layer in enumerate(llm.model.layers):
        fill_random(layer, f"model.layers.{index}")
        quantize_decoder_layer(layer, quantization, dtype)
    for name in ("embed_tokens", "norm"):
        fill_random(getattr(llm.model, name), f"model.{name}")
    fill_random(llm.lm_head, "lm_head")
    for module in (tts_model, audio):
        if module is not None:
            fill_random(module)
    for module in (llm, tts_model, audio):
        if module is not None:
            module.eval()
    decoder = SpeechDecoder().to(device).eval()
    return LoadedModel(config, llm, tts_model, decoder, word_level_tokenizer(config.vocab_size),
                       tts_tokenizer, Path(tts_tokenizer_dir), audio)


def synthetic_voice_clip(seed: int, seconds: float = 5.0, sample_rate_hz: int = 16_000) -> np.ndarray:
    """A deterministic voice-like reference clip (float32 mono, peak 0.5) for tests and
    benchmarks: eight harmonics of a pitch between 90 and 250 Hz drawn from ``seed``, a slow
    syllable-like amplitude modulation and a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate_hz)) / sample_rate_hz
    pitch = 90.0 + 160.0 * rng.random()
    wave = sum(rng.random() / k * np.sin(2 * np.pi * k * pitch * t + 2 * np.pi * rng.random())
               for k in range(1, 9))
    wave = wave * (0.6 + 0.4 * np.sin(2 * np.pi * (2.0 + 3.0 * rng.random()) * t))
    wave = wave + 0.01 * rng.standard_normal(t.size)
    return (0.5 * wave / np.abs(wave).max()).astype(np.float32)
