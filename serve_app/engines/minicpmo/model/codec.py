"""Codes to 24 kHz audio for MiniCPM-o 2.6: the ChatTTS DVAE decoder and Vocos.

How they fit in: docs/minicpmo.md, "Codes to audio". Module attribute names mirror the checkpoint keys (``tts.dvae.*``
in the safetensors shards, ``backbone.*`` / ``head.*`` in ``assets/Vocos.pt``), so loading is a
plain ``load_state_dict`` of the decode keys. The DVAE encoder and the Vocos feature extractor
are never built.

Batch invariance: :meth:`SpeechDecoder.decode` batches only sequences of equal length, because
zero-padding a shorter one would change the convolutions' outputs near its end.
"""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from vector_quantize_pytorch import GroupedResidualFSQ

from ..device.transfer import to_device

SAMPLE_RATE_HZ = 24_000
NUM_MEL_BINS = 100
NUM_CODEBOOKS = 4
CODEBOOK_SIZE = 625  # 5**4 FSQ codes; the TTS's 626th token is end-of-audio and never decoded
MEL_FRAMES_PER_CODE_FRAME = 2
HOP_SAMPLES = 256
SAMPLES_PER_CODE_FRAME = MEL_FRAMES_PER_CODE_FRAME * HOP_SAMPLES  # 512
CONTEXT_FRAMES = 4  # frames of the previous generate call re-decoded in front of a new piece
OVERLAP_SAMPLES = CONTEXT_FRAMES * SAMPLES_PER_CODE_FRAME  # 2048

DVAE_KEY_PREFIX = "tts.dvae."
# Relative to DVAE_KEY_PREFIX; ``encoder.*`` and ``downsample_conv.*`` only serve encoding.
DVAE_DECODE_PREFIXES = ("coef", "decoder.", "out_conv.", "vq_layer.quantizer.")
# ``feature_extractor.*`` (mel analysis) is not needed to synthesise audio.
VOCOS_DECODE_PREFIXES = ("backbone.", "head.")


def _is_decode_key(relative_key: str, prefixes: Sequence[str]) -> bool:
    """A prefix ending in "." matches a subtree; any other names one exact key."""
    return any(relative_key == p if not p.endswith(".") else relative_key.startswith(p)
               for p in prefixes)


def dvae_decode_keys(keys: Iterable[str]) -> list[str]:
    """The full checkpoint keys (``tts.dvae.…``) among ``keys`` that the DVAE decoder loads."""
    return [key for key in keys if key.startswith(DVAE_KEY_PREFIX)
            and _is_decode_key(key[len(DVAE_KEY_PREFIX):], DVAE_DECODE_PREFIXES)]


def vocos_decode_keys(keys: Iterable[str]) -> list[str]:
    """The ``assets/Vocos.pt`` keys among ``keys`` that :class:`Vocos` loads."""
    return [key for key in keys if _is_decode_key(key, VOCOS_DECODE_PREFIXES)]


class ConvNeXtBlock(nn.Module):
    """Residual depthwise-conv block shared by the DVAE and Vocos (k7, LayerNorm eps 1e-6, GELU).

    The layer scale parameter is named by the subclass (``coef`` in the DVAE, ``gamma`` in Vocos).
    """

    def __init__(self, dim: int, intermediate_dim: int, dilation: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel_size=7, padding=3 * dilation, dilation=dilation,
                                groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate_dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(intermediate_dim, dim)

    def layer_scale(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, T] -> [B, C, T]."""
        y = self.norm(self.dwconv(x).transpose(1, 2))
        y = self.pwconv2(self.act(self.pwconv1(y))) * self.layer_scale()
        return x + y.transpose(1, 2)


class DVAEConvNeXtBlock(ConvNeXtBlock):
    def __init__(self, dim: int, intermediate_dim: int, dilation: int) -> None:
        super().__init__(dim, intermediate_dim, dilation)
        self.coef = nn.Parameter(torch.empty(dim))

    def layer_scale(self) -> torch.Tensor:
        return self.coef


class VocosConvNeXtBlock(ConvNeXtBlock):
    def __init__(self, dim: int, intermediate_dim: int) -> None:
        super().__init__(dim, intermediate_dim, dilation=1)
        self.gamma = nn.Parameter(torch.empty(dim))

    def layer_scale(self) -> torch.Tensor:
        return self.gamma


class DVAEConvStack(nn.Module):
    """ChatTTS ``DVAEDecoder``: conv 512->128->256, 12 dilated ConvNeXt blocks, conv 256->512."""

    def __init__(self, in_dim: int = 512, out_dim: int = 512, bottleneck_dim: int = 128,
                 hidden_dim: int = 256, num_layers: int = 12) -> None:
        super().__init__()
        self.conv_in = nn.Sequential(
            nn.Conv1d(in_dim, bottleneck_dim, 3, 1, 1),
            nn.GELU(),
            nn.Conv1d(bottleneck_dim, hidden_dim, 3, 1, 1),
        )
        self.decoder_block = nn.ModuleList(
            DVAEConvNeXtBlock(hidden_dim, 4 * hidden_dim, dilation=2) for _ in range(num_layers))
        self.conv_out = nn.Conv1d(hidden_dim, out_dim, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.decoder_block:
            x = block(x)
        return self.conv_out(x)


class GroupedFSQEmbedding(nn.Module):
    """Decode half of ChatTTS ``GFSQ``: codes [B, T, 4] -> features [B, 1024, T].

    Codebooks 0 and 1 are the two residual levels of group 0, codebooks 2 and 3 those of group 1.
    Residual level r is scaled by (level - 1) ** -r, as in vector-quantize-pytorch 1.18.5 which
    upstream pins; later releases use level ** -r, which would change every waveform.
    """

    LEVELS = (5, 5, 5, 5)

    def __init__(self) -> None:
        super().__init__()
        self.quantizer = GroupedResidualFSQ(dim=1024, levels=list(self.LEVELS), num_quantizers=2,
                                            groups=2)
        levels = torch.tensor(self.LEVELS, dtype=torch.float32)
        for residual_fsq in self.quantizer.rvqs:
            residual_fsq.scales.copy_(torch.stack(
                [(levels - 1) ** -level for level in range(residual_fsq.num_quantizers)]))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        batch, frames, _ = codes.shape
        indices = codes.reshape(batch, frames, 2, 2).permute(2, 0, 1, 3)  # group, B, T, residual
        return self.quantizer.get_output_from_indices(indices).transpose(1, 2)


class DVAEDecoder(nn.Module):
    """The decode path of the ChatTTS DVAE; state dict = ``tts.dvae.*`` decode keys, unprefixed."""

    def __init__(self) -> None:
        super().__init__()
        self.coef = nn.Parameter(torch.empty(1, NUM_MEL_BINS, 1))
        self.decoder = DVAEConvStack()
        self.out_conv = nn.Conv1d(512, NUM_MEL_BINS, 3, 1, 1, bias=False)
        self.vq_layer = GroupedFSQEmbedding()

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [B, T, 4] (int64, values < 625) -> mel [B, 100, 2T]."""
        features = self.vq_layer(codes)
        batch, channels, frames = features.shape
        # Each frame's two 512-channel halves become two consecutive mel-rate steps.
        features = features.view(batch, 2, channels // 2, frames).permute(0, 2, 3, 1).flatten(2)
        return self.out_conv(self.decoder(features)) * self.coef


class VocosBackbone(nn.Module):
    def __init__(self, input_channels: int = NUM_MEL_BINS, dim: int = 512,
                 intermediate_dim: int = 1536, num_layers: int = 8) -> None:
        super().__init__()
        self.embed = nn.Conv1d(input_channels, dim, kernel_size=7, padding=3)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.convnext = nn.ModuleList(
            VocosConvNeXtBlock(dim, intermediate_dim) for _ in range(num_layers))
        self.final_layer_norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Mel [B, 100, F] -> hidden [B, F, 512]."""
        x = self.norm(self.embed(mel).transpose(1, 2)).transpose(1, 2)
        for block in self.convnext:
            x = block(x)
        return self.final_layer_norm(x.transpose(1, 2))


class ISTFT(nn.Module):
    """Inverse STFT with Vocos' "same" padding: F frames -> hop * F samples.

    ``torch.istft(center=True)`` trims differently and refuses the edge frames (NOLA), so the
    overlap-add and the window-envelope normalisation are written out.
    """

    def __init__(self, n_fft: int = 1024, hop_samples: int = HOP_SAMPLES) -> None:
        super().__init__()
        self.n_fft = n_fft
        self.hop_samples = hop_samples
        self.register_buffer("window", torch.hann_window(n_fft))

    def _overlap_add(self, frames: torch.Tensor) -> torch.Tensor:
        """[B, n_fft, F] windowed frames -> [B, (F - 1) * hop + n_fft] summed signal."""
        length = (frames.shape[-1] - 1) * self.hop_samples + self.n_fft
        return F.fold(frames, output_size=(1, length), kernel_size=(1, self.n_fft),
                      stride=(1, self.hop_samples))[:, 0, 0]

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        """Complex spectrum [B, n_fft / 2 + 1, F] -> waveform [B, hop * F]."""
        window = self.window.to(torch.float32)
        frames = torch.fft.irfft(spec, self.n_fft, dim=1, norm="backward") * window[None, :, None]
        audio = self._overlap_add(frames)
        squared_windows = window.square()[None, :, None].expand(1, -1, spec.shape[-1])
        envelope = self._overlap_add(squared_windows)[0]
        trim = (self.n_fft - self.hop_samples) // 2
        end = audio.shape[-1] - trim
        return audio[:, trim:end] / envelope[trim:end]


class ISTFTHead(nn.Module):
    """Linear 512 -> 513 log-magnitudes + 513 phases, then :class:`ISTFT` (always in fp32)."""

    def __init__(self, dim: int = 512, n_fft: int = 1024, hop_samples: int = HOP_SAMPLES) -> None:
        super().__init__()
        self.out = nn.Linear(dim, n_fft + 2)
        self.istft = ISTFT(n_fft, hop_samples)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden [B, F, 512] -> waveform [B, 256 F] (float32)."""
        log_magnitude, phase = self.out(hidden).float().transpose(1, 2).chunk(2, dim=1)
        magnitude = torch.exp(log_magnitude).clip(max=1e2)  # Vocos' guard against huge magnitudes
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return self.istft(spec)


class Vocos(nn.Module):
    """Vocos mel vocoder, decode only: ``assets/Vocos.pt`` minus ``feature_extractor.*``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = VocosBackbone()
        self.head = ISTFTHead()

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Mel [B, 100, F] -> waveform [B, 256 F] at 24 kHz (float32)."""
        return self.head(self.backbone(mel))


def read_dvae_state_dict(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The DVAE decode tensors (keys without ``tts.dvae.``), read from the safetensors shard(s).

    Handles a single ``model.safetensors`` or shards listed in ``model.safetensors.index.json``;
    only the decode keys are read.
    """
    from safetensors import safe_open

    checkpoint = Path(checkpoint_dir)
    index_path = checkpoint / "model.safetensors.index.json"
    if index_path.exists():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    else:
        with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
            weight_map = {key: "model.safetensors" for key in handle.keys()}
    keys_by_file: dict[str, list[str]] = defaultdict(list)
    for key in dvae_decode_keys(weight_map):
        keys_by_file[weight_map[key]].append(key)
    state: dict[str, torch.Tensor] = {}
    for file_name, keys in keys_by_file.items():
        with safe_open(str(checkpoint / file_name), framework="pt") as handle:
            for key in keys:
                state[key[len(DVAE_KEY_PREFIX):]] = handle.get_tensor(key)
    return state


def read_vocos_state_dict(vocos_path: str | Path) -> dict[str, torch.Tensor]:
    """The Vocos decode tensors from ``assets/Vocos.pt`` (a plain torch state dict)."""
    state = torch.load(vocos_path, map_location="cpu", weights_only=True, mmap=True)
    return {key: state[key] for key in vocos_decode_keys(state)}


@contextmanager
def _ieee_fp32(enabled: bool) -> Iterator[None]:
    """Run CUDA fp32 convolutions and matmuls without TF32 (cuDNN convolutions default to TF32).

    TF32 puts the mel 5e-5 off upstream's fp32 (rtol 1e-4 fails); full fp32 cost nothing
    measurable at these sizes on an H200 (latency-bound). The switch is process-wide while on.
    """
    if not enabled:
        yield
        return
    if hasattr(torch.backends.cudnn, "conv"):  # torch >= 2.9
        flags = [(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
                 (torch.backends.cuda.matmul, "fp32_precision", "ieee")]
    else:
        flags = [(torch.backends.cudnn, "allow_tf32", False),
                 (torch.backends.cuda.matmul, "allow_tf32", False)]
    saved = [getattr(owner, name) for owner, name, _ in flags]
    for owner, name, value in flags:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name, _), value in zip(flags, saved):
            setattr(owner, name, value)


class SpeechDecoder(nn.Module):
    """DVAE + Vocos: batches of code frames to 24 kHz waveforms.

    Runs on its parameters' device and dtype (fp32 unless cast); the ISTFT always runs in fp32.
    With ``allow_tf32`` False (default) CUDA fp32 convolutions and matmuls skip TF32, so the
    output matches upstream's fp32 within 1e-6.
    """

    def __init__(self, allow_tf32: bool = False) -> None:
        super().__init__()
        self.dvae = DVAEDecoder()
        self.vocos = Vocos()
        self.allow_tf32 = allow_tf32

    @classmethod
    def from_state_dicts(cls, dvae_state: dict[str, torch.Tensor],
                         vocos_state: dict[str, torch.Tensor],
                         device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32,
                         allow_tf32: bool = False) -> "SpeechDecoder":
        """Build from ``tts.dvae.*`` decode tensors (prefix stripped) and Vocos decode tensors."""
        decoder = cls(allow_tf32)
        decoder.dvae.load_state_dict(dvae_state)
        decoder.vocos.load_state_dict(vocos_state)
        return decoder.to(device=device, dtype=dtype).eval()

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32,
                        allow_tf32: bool = False) -> "SpeechDecoder":
        """Build from a checkpoint folder in the official layout (reads only the decode tensors)."""
        checkpoint = Path(checkpoint_dir)
        return cls.from_state_dicts(read_dvae_state_dict(checkpoint),
                                    read_vocos_state_dict(checkpoint / "assets" / "Vocos.pt"),
                                    device, dtype, allow_tf32)

    @property
    def device(self) -> torch.device:
        return self.dvae.coef.device

    def _precision(self) -> AbstractContextManager[None]:
        return _ieee_fp32(self.device.type == "cuda" and not self.allow_tf32)

    @torch.inference_mode()
    def codes_to_mel(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [B, T, 4] -> mel [B, 100, 2T] (parameter dtype)."""
        with self._precision():
            return self.dvae(codes.to(device=self.device, dtype=torch.long))

    @torch.inference_mode()
    def mel_to_audio(self, mel: torch.Tensor) -> torch.Tensor:
        """Mel [B, 100, F] -> waveform [B, 256 F] float32."""
        with self._precision():
            return self.vocos(mel.to(device=self.device, dtype=self.dvae.coef.dtype))

    def decode(self, codes_list: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Waveforms for code sequences: ``codes_list[i]`` [T_i, 4] -> float32 [T_i * 512].

        Sequences of equal length run as one batch, so each result is what the sequence gives
        decoded alone. Codes must lie in [0, 625) (strip end-of-audio 625 first). Results are on
        the decoder's device.
        """
        for codes in codes_list:
            if codes.dim() != 2 or codes.shape[1] != NUM_CODEBOOKS:
                raise ValueError(f"codes must be [T, {NUM_CODEBOOKS}], got {tuple(codes.shape)}")
        indices_by_length: dict[int, list[int]] = defaultdict(list)
        for index, codes in enumerate(codes_list):
            indices_by_length[codes.shape[0]].append(index)
        waveforms: list[torch.Tensor | None] = [None] * len(codes_list)
        for frames, indices in indices_by_length.items():
            audio = self.decode_batch(torch.stack([codes_list[index] for index in indices]))
            for row, index in enumerate(indices):
                waveforms[index] = audio[row]
        return waveforms  # type: ignore[return-value]

    def decode_batch(self, codes: torch.Tensor) -> torch.Tensor:
        """Waveforms [B, T * 512] of B code sequences of one length, ``codes`` [B, T, 4]: what
        :meth:`decode` gives each of them, as one tensor."""
        if codes.dim() != 3 or codes.shape[2] != NUM_CODEBOOKS:
            raise ValueError(f"codes must be [B, T, {NUM_CODEBOOKS}], got {tuple(codes.shape)}")
        if codes.shape[1] == 0:
            return torch.zeros(codes.shape[0], 0, device=self.device)
        return self.mel_to_audio(self.codes_to_mel(to_device(codes, self.device)))
