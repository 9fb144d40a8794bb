"""MiniCPM-o's audio-in path, as far as voice cloning needs it (docs/minicpmo.md, "Cloned voices").

A reference clip is checked and resampled to 16 kHz (soxr), turned into Whisper log-mel
features (transformers' ``WhisperFeatureExtractor``), encoded by the Whisper encoder ``apm``
(transformers' ``WhisperEncoder`` modules, run on the clip's own length as upstream does),
projected to the LLM's width by ``audio_projection_layer`` and average-pooled by
``audio_pool_step``: one embedding per 40 ms of audio, which takes the place of an ``<unk>``
placeholder in the LLM input.

Two attention forms: upstream's ``chat`` encodes with a chunk mask (each encoder frame sees its
own ``audio_chunk_length`` chunk and all earlier ones), its streaming API with full attention.
The engine's voices use the chunked form (the ``chat`` recipe).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import soxr
import torch
import torch.nn.functional as F
from torch import nn

from ...base import MAX_CLIP_RATE_HZ, MAX_CLIP_S, MIN_CLIP_RATE_HZ, MIN_CLIP_S, InvalidRequestError
from .modeling import AudioInConfig, Projector, pooled_frames

SAMPLE_RATE_HZ = 16_000  # the encoder's rate
SILENT_PEAK = 1e-3  # a clip whose loudest sample is below -60 dBFS holds no voice


def prepare_clip(samples: np.ndarray, sample_rate_hz: int) -> np.ndarray:
    """A reference clip checked and resampled to 16 kHz float32 (soxr); a clip that cannot be a
    voice is refused with :class:`InvalidRequestError` (``param="audio_sample"``)."""

    def refuse(message: str, code: str) -> InvalidRequestError:
        return InvalidRequestError(message, "audio_sample", code=code)

    if not isinstance(sample_rate_hz, (int, np.integer)) or isinstance(sample_rate_hz, bool) or not (
            MIN_CLIP_RATE_HZ <= sample_rate_hz <= MAX_CLIP_RATE_HZ):
        raise refuse(f"sample rate must be an integer from {MIN_CLIP_RATE_HZ} to "
                     f"{MAX_CLIP_RATE_HZ} Hz", "unsupported_sample_rate")
    samples = np.asarray(samples)
    if samples.dtype.kind not in "if":
        raise refuse("the audio sample must be an array of numbers", "invalid_audio")
    if samples.ndim == 2 and 1 in samples.shape:
        samples = samples.reshape(-1)
    if samples.ndim != 1:
        raise refuse("the audio sample must be mono (one channel)", "audio_not_mono")
    if samples.size == 0:
        raise refuse("the audio sample is empty", "audio_empty")
    duration_s = samples.size / sample_rate_hz
    if duration_s < MIN_CLIP_S:
        raise refuse(f"the audio sample is {duration_s:.2f} s; a voice needs at least "
                     f"{MIN_CLIP_S:.0f} s", "audio_too_short")
    if duration_s > MAX_CLIP_S:
        raise refuse(f"the audio sample is {duration_s:.1f} s; at most {MAX_CLIP_S:.0f} s",
                     "audio_too_long")
    if samples.dtype.kind == "i":  # integer PCM: full scale is 1.0
        samples = samples / float(np.iinfo(samples.dtype).max + 1)
    samples = samples.astype(np.float32, copy=False)
    if not np.isfinite(samples).all():
        raise refuse("the audio sample holds NaN or infinite values", "audio_not_finite")
    if float(np.abs(samples).max()) < SILENT_PEAK:
        raise refuse("the audio sample is silent", "audio_silent")
    if sample_rate_hz != SAMPLE_RATE_HZ:
        samples = soxr.resample(samples, int(sample_rate_hz), SAMPLE_RATE_HZ)
    return np.ascontiguousarray(samples[:int(MAX_CLIP_S * SAMPLE_RATE_HZ)], dtype=np.float32)


def chunk_attention(frames: int, chunk_frames: int, device: torch.device | None = None) -> torch.Tensor:
    """Upstream ``chat``'s encoder mask [frames, frames] (True = visible): frame i sees its own
    ``chunk_frames`` chunk and every earlier one."""
    index = torch.arange(frames, device=device)
    visible_until = torch.clamp((index // chunk_frames + 1) * chunk_frames, max=frames)
    return index[None, :] < visible_until[:, None]


@dataclass
class EncodedClip:
    """Each stage of one clip's encoding (batch 1 dropped): encoder output [C, d_model],
    projected [C, H], pooled embeddings [T, H]."""

    encoder_hidden: torch.Tensor
    projected: torch.Tensor
    embeddings: torch.Tensor


class ClipEncoder(nn.Module):
    """``apm`` (transformers' ``WhisperEncoder``) and ``audio_projection_layer``, with the
    feature extractor; attribute names mirror the checkpoint keys."""

    def __init__(self, config: AudioInConfig, llm_hidden: int) -> None:
        super().__init__()
        from transformers import WhisperFeatureExtractor
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        self.config = config
        whisper = config.whisper_config()
        self.apm = WhisperEncoder(whisper)
        self.audio_projection_layer = Projector(config.encoder_width, llm_hidden)
        self.feature_extractor = WhisperFeatureExtractor(feature_size=whisper.num_mel_bins,
                                                         sampling_rate=SAMPLE_RATE_HZ)

    def features(self, clip: np.ndarray) -> torch.Tensor:
        """Log-mel features [1, mels, F] of a 16 kHz clip of at most 30 s, cut to its own
        length (F = ceil(samples / 160)) after normalising over the padded 30 s window, as
        upstream's processor does."""
        out = self.feature_extractor(clip, sampling_rate=SAMPLE_RATE_HZ, padding="max_length",
                                     return_attention_mask=True, return_tensors="pt")
        frames = int(out["attention_mask"].sum())
        return out["input_features"][:, :, :frames]

    def encode(self, features: torch.Tensor, chunked: bool = True) -> EncodedClip:
        """Features [1, mels, F] -> every stage of the encoding; ``chunked``: upstream ``chat``'s
        chunk mask, else full attention (its streaming API)."""
        apm = self.apm
        dtype = apm.conv1.weight.dtype
        x = F.gelu(apm.conv1(features.to(apm.conv1.weight.device, dtype)))
        x = F.gelu(apm.conv2(x)).transpose(1, 2)
        frames = x.shape[1]
        x = x + apm.embed_positions.weight[:frames]
        mask = (chunk_attention(frames, self.config.chunk_frames, x.device)[None, None]
                if chunked else None)
        for layer in apm.layers:
            x = layer(x, mask)
        hidden = apm.layer_norm(x)
        projected = self.audio_projection_layer(hidden)
        pooled = F.avg_pool1d(projected.transpose(1, 2), self.config.pool_step,
                              self.config.pool_step).transpose(1, 2)
        tokens = pooled_frames(frames, self.config.pool_step)
        return EncodedClip(hidden[0], projected[0], pooled[0, :tokens])

    def embed(self, clip: np.ndarray) -> torch.Tensor:
        """A prepared 16 kHz clip -> its voice embeddings [T, H] (chunked attention)."""
        return self.encode(self.features(clip), chunked=True).embeddings
