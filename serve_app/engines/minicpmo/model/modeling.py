"""The two transformer stages of MiniCPM-o's speech path, over slot KV caches.

``QwenLM`` mirrors the checkpoint's ``llm.*`` keys, ``SpeechTokenModel`` the ``tts.*`` keys the
speech path needs (``projector``, ``emb_code``, ``emb_text``, ``head_code``, ``model``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layers import DecoderShape, SlotDecoder, SlotKVCache, StepInputs


@dataclass(frozen=True)
class TTSConfig:
    llm_dim: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    num_audio_tokens: int = 626
    num_text_tokens: int = 21178
    num_vq: int = 4
    spk_emb_token_id: int = 21143
    audio_bos_token_id: int = 21132
    text_eos_token_id: int = 21133
    num_spk_embs: int = 1
    streaming_text_chunk_size: int = 10
    streaming_text_reserved_len: int = 300
    streaming_audio_chunk_size: int = 50
    top_p: float = 0.7
    top_k: int = 20
    repetition_penalty: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def eos_code(self) -> int:
        return self.num_audio_tokens - 1

    @property
    def condition_length(self) -> int:
        """[Stts] + speaker slots + reserved text + [Ptts]: 303 positions for the real model."""
        return 1 + self.num_spk_embs + self.streaming_text_reserved_len + 1

    @property
    def text_start(self) -> int:
        return 1 + self.num_spk_embs

    @property
    def audio_bos_position(self) -> int:
        return self.condition_length - 1


MEL_FRAMES_PER_S = 100  # Whisper features: one frame per 10 ms
_WHISPER_ENCODER_FIELDS = ("d_model", "num_mel_bins", "max_source_positions", "scale_embedding",
                           "activation_function", "dropout", "attention_dropout",
                           "activation_dropout")


def encoder_frames(mel_frames: int) -> int:
    """Frames after the encoder's stride-2 convolution."""
    return (mel_frames - 1) // 2 + 1


def pooled_frames(frames: int, pool_step: int) -> int:
    return (frames - pool_step) // pool_step + 1


@dataclass(frozen=True)
class AudioInConfig:
    """What ``config.json`` says about the audio-in path."""

    encoder: dict[str, Any]  # ``audio_config``: a WhisperConfig
    pool_step: int = 2
    chunk_length_s: float = 1.0

    @classmethod
    def from_config(cls, raw: dict) -> "AudioInConfig | None":
        """None for a checkpoint without an audio encoder."""
        if not raw.get("audio_config"):
            return None
        return cls(encoder=dict(raw["audio_config"]), pool_step=int(raw.get("audio_pool_step", 2)),
                   chunk_length_s=float(raw.get("audio_chunk_length", 1.0)))

    def whisper_config(self):
        """A ``WhisperConfig`` of the encoder's own fields (the decoder's are never used)."""
        from transformers import WhisperConfig

        fields = {k: v for k, v in self.encoder.items()
                  if k.startswith("encoder_") or k in _WHISPER_ENCODER_FIELDS}
        config = WhisperConfig(**fields)
        config._attn_implementation = "sdpa"
        return config

    @property
    def encoder_width(self) -> int:
        """The width upstream projects from (``encoder_ffn_dim // 4``, the encoder's d_model)."""
        return int(self.encoder["encoder_ffn_dim"]) // 4

    @property
    def chunk_frames(self) -> int:
        """Encoder frames per attention chunk (50 for 1 s)."""
        return encoder_frames(int(self.chunk_length_s * MEL_FRAMES_PER_S))

    @property
    def tokens_per_chunk(self) -> int:
        """Audio embeddings (LLM placeholders) per chunk: 25 for 1 s."""
        return pooled_frames(self.chunk_frames, self.pool_step)

    @property
    def max_audio_tokens(self) -> int:
        """Audio embeddings of the longest clip (750 for 30 s)."""
        return pooled_frames(int(self.encoder.get("max_source_positions", 1500)), self.pool_step)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs from ``config.json``."""

    llm: DecoderShape
    vocab_size: int
    tts: TTSConfig
    audio: AudioInConfig | None = None  # the audio-in path (voice cloning); None if absent

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        llm = DecoderShape(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
            num_kv_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            rope_theta=float(raw.get("rope_theta", 1e6)), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            qkv_bias=True)
        known = TTSConfig.__dataclass_fields__
        tts = TTSConfig(**{k: v for k, v in raw["tts_config"].items() if k in known})
        return cls(llm=llm, vocab_size=raw["vocab_size"], tts=tts,
                   audio=AudioInConfig.from_config(raw))

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def tts_shape(self) -> DecoderShape:
        t = self.tts
        return DecoderShape(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                            num_layers=t.num_hidden_layers, num_heads=t.num_attention_heads,
                            num_kv_heads=t.num_attention_heads, rope_theta=t.rope_theta,
                            rms_norm_eps=t.rms_norm_eps, qkv_bias=False)


class QwenBody(SlotDecoder):
    def __init__(self, shape: DecoderShape, vocab_size: int) -> None:
        super().__init__(shape)
        self.embed_tokens = nn.Embedding(vocab_size, shape.hidden_size)


class QwenLM(nn.Module):
    """Qwen2 causal LM (``model.*``, ``lm_head``) stepping over a slot cache."""

    def __init__(self, shape: DecoderShape, vocab_size: int) -> None:
        super().__init__()
        self.model = QwenBody(shape, vocab_size)
        self.lm_head = nn.Linear(shape.hidden_size, vocab_size, bias=False)

    def hidden_states(self, token_ids: torch.Tensor, cache: SlotKVCache,
                      step: StepInputs) -> torch.Tensor:
        """Final-norm hidden states [B, S, H] of ``token_ids`` [B, S]."""
        return self.model(self.model.embed_tokens(token_ids), cache, step)

    def hidden_states_of_embeddings(self, embeddings: torch.Tensor, cache: SlotKVCache,
                                    step: StepInputs) -> torch.Tensor:
        """Final-norm hidden states [B, S, H] of input embeddings [B, S, H]."""
        return self.model(embeddings, cache, step)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class Projector(nn.Module):
    """Two linear layers with a ReLU, in_dim -> out_dim -> out_dim: the TTS model's
    ``projector`` and the ``audio_projection_layer``."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))


class SpeechTokenModel(nn.Module):
    """ConditionalChatTTS's decoder: text/code embeddings in, 4 codebooks of logits out.

    ``head_code`` holds the weight-normed heads folded into one [num_vq * codes, hidden] matrix
    (the loader folds ``original0``/``original1``), so one matmul yields every codebook.
    """

    def __init__(self, config: TTSConfig, shape: DecoderShape) -> None:
        super().__init__()
        self.config = config
        self.projector = Projector(config.llm_dim, config.hidden_size)
        self.emb_code = nn.ModuleList(
            [nn.Embedding(config.num_audio_tokens, config.hidden_size) for _ in range(config.num_vq)])
        self.emb_text = nn.Embedding(config.num_text_tokens, config.hidden_size)
        self.head_code = nn.Linear(config.hidden_size, config.num_vq * config.num_audio_tokens, bias=False)
        self.model = SlotDecoder(shape)

    def speaker_embedding(self, llm_hidden: torch.Tensor) -> torch.Tensor:
        """LLM hidden state at ``<|spk|>`` [B, llm_dim] -> L2-normalised TTS embedding [B, H]."""
        projected = self.projector(llm_hidden.to(self.projector.linear1.weight.dtype))
        return F.normalize(projected, p=2, dim=-1)

    def code_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the codebook embeddings of frames [..., num_vq] -> [..., H]."""
        parts = [self.emb_code[i](codes[..., i]) for i in range(self.config.num_vq)]
        return torch.stack(parts, -1).sum(-1)

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] -> float logits [B, num_vq, codes]."""
        logits = self.head_code(hidden).float()
        return logits.view(hidden.shape[0], self.config.num_vq, self.config.num_audio_tokens)

    def forward(self, inputs: torch.Tensor, cache: SlotKVCache, step: StepInputs) -> torch.Tensor:
        return self.model(inputs, cache, step)
