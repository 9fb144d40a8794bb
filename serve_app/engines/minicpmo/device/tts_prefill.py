"""The TTS cache's prefills besides the audio steps, as plain functions: the host-side inputs of
batched text prefill passes (:func:`text_prefill_passes`; the passes themselves are
:func:`~.audio_step.text_prefill_step` or its graphs) and a new segment's carried-audio prefill
(:func:`carry_prefill`)."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

from ..model.layers import SlotKVCache, StepInputs
from ..model.modeling import SpeechTokenModel, TTSConfig
from ..speech_schedule import TextPrefill
from .audio_step import LONG_PREFILL_TOKENS, PREFILL_TOKENS, audio_visibility

# one pass: TTS slots, then ids, positions, valid and where the speaker embedding goes ([B, width])
TextPrefillPass = tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def text_prefill_passes(items: Sequence[tuple[int, TextPrefill]],
                        spk_emb_token_id: int) -> Iterator[TextPrefillPass]:
    """The passes of batched text prefills (TTS slot, work item), CPU tensors: items of up to
    :data:`PREFILL_TOKENS` tokens in passes of that width, then longer ones in passes of
    :data:`LONG_PREFILL_TOKENS` (causal, so a long prefill split in passes writes exactly what
    one pass would). Made one at a time, as the caller asks for the next."""
    short = [(slot, item) for slot, item in items if len(item.token_ids) <= PREFILL_TOKENS]
    long = [(slot, item) for slot, item in items if len(item.token_ids) > PREFILL_TOKENS]
    for group, width in ((short, PREFILL_TOKENS), (long, LONG_PREFILL_TOKENS)):
        if group:
            yield from _passes(group, width, spk_emb_token_id)


def _passes(items: Sequence[tuple[int, TextPrefill]], width: int,
            spk_emb_token_id: int) -> Iterator[TextPrefillPass]:
    passes = max((len(item.token_ids) + width - 1) // width for _, item in items)
    for index in range(passes):
        batch = [(slot, item) for slot, item in items if len(item.token_ids) > index * width]
        ids = np.zeros((len(batch), width), dtype=np.int64)
        positions = np.zeros((len(batch), width), dtype=np.int64)
        valid = np.zeros((len(batch), width), dtype=bool)
        speaker_at = np.zeros((len(batch), width), dtype=bool)
        for row, (_, item) in enumerate(batch):
            part = item.token_ids[index * width:(index + 1) * width]
            start = item.start + index * width
            ids[row, :len(part)] = part
            positions[row, :len(part)] = np.arange(start, start + len(part))
            valid[row, :len(part)] = True
            if item.with_speaker:
                speaker_at[row, :len(part)] = np.asarray(part) == spk_emb_token_id
        slots = [slot for slot, _ in batch]
        yield slots, *(torch.from_numpy(a) for a in (ids, positions, valid, speaker_at))


def carry_prefill(tts: SpeechTokenModel, cfg: TTSConfig, cache: SlotKVCache, slot: int,
                  frames: list[list[int]], text_len: int, device: torch.device) -> None:
    """``[Ptts]`` and the carried frames (all but the last) into a new segment's cache, slot
    ``slot`` (whose text holds ``text_len`` tokens), eagerly."""
    codes = torch.tensor(frames[:-1], dtype=torch.long, device=device).view(-1, cfg.num_vq)
    bos = tts.emb_text(torch.tensor([cfg.audio_bos_token_id], device=device))
    embeds = torch.cat([bos, tts.code_embedding(codes)], dim=0)[None]
    count = embeds.shape[1]
    positions = torch.arange(cfg.audio_bos_position, cfg.audio_bos_position + count,
                             device=device)[None]
    keys = torch.arange(cache.max_positions + 1, device=device)
    row = audio_visibility(keys, torch.tensor([cfg.audio_bos_position + count - 1], device=device),
                           torch.tensor([cfg.audio_bos_position], device=device),
                           torch.tensor([text_len], device=device), cfg)
    attend = row[:, None, None, :].expand(1, 1, count, row.shape[-1])
    rows = torch.tensor([slot], device=device)
    tts(embeds, cache, StepInputs(rows, positions, positions, attend))
