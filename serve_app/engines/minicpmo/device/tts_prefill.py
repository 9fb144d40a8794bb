"""The TTS cache's prefills besides the audio steps: batched text prefill passes
(:func:`text_prefill_step`, as CUDA graphs :class:`TextPrefillGraphs`), their host-side inputs
(:func:`text_prefill_passes`) and a new segment's carried-audio prefill (:func:`carry_prefill`)."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

from ..model.layers import SlotKVCache, StepInputs, causal_attend
from ..model.modeling import SpeechTokenModel, TTSConfig
from ..speech_schedule import TextPrefill
from .audio_step import audio_visibility
from .graphs import bucket_sizes, capture_per_bucket, shortest_span
from .transfer import to_device

PREFILL_TOKENS = 16  # text prefill pass width: a chunk is 10-12 tokens
# pass width for longer text (the tail of a long piece, a carried segment's start): a pass of
# a few streams is bound by its kernel launches on a GPU, and a 170-token tail in passes of 16
# took 11 passes, 25-47 ms of one step, on an H100
LONG_PREFILL_TOKENS = 128
TEXT_PREFILL_SPANS = (64, 128)  # key counts text prefill graphs read below the whole text part


def text_prefill_step(tts: SpeechTokenModel, cache: SlotKVCache, ids: torch.Tensor,
                      positions: torch.Tensor, valid: torch.Tensor, speaker: torch.Tensor,
                      speaker_at: torch.Tensor, rows: torch.Tensor, contiguous: bool,
                      key_count: int | None = None) -> None:
    """Write text embeddings (the speaker embedding where ``speaker_at``) into the cache, causal.

    ``ids``/``positions``/``valid``/``speaker_at`` [B, S]; ``speaker`` [B, H]. Padded tokens
    write to the scratch position and see only key 0. Attention reads the first ``key_count``
    cache positions (default: all the text part; fewer must still hold every query's position).
    """
    embeds = tts.emb_text(ids)
    embeds = torch.where(speaker_at[:, :, None], speaker[:, None, :].to(embeds.dtype), embeds)
    write = torch.where(valid, positions, torch.full_like(positions, cache.scratch_position))
    attend = causal_attend(positions, valid, key_count or text_key_count(tts.config, cache))
    tts(embeds, cache, StepInputs(rows, positions, write, attend, contiguous))


def text_key_count(cfg: TTSConfig, cache: SlotKVCache) -> int:
    """Keys a text prefill may see: text lies below ``condition_length``, so attention need not
    read the audio part of the cache."""
    return min(cfg.condition_length, cache.max_positions + 1)


class TextPrefillGraphs:
    """:func:`text_prefill_step` of width :data:`PREFILL_TOKENS` as CUDA graphs, bucketed by the
    number of prefilling streams (few per step) and by the keys attention reads: their cache
    rows are gathered by slot index, so a prefill costs what its own rows cost, not what the
    busiest slot range does, and only up to the bucket past the pass's last position (a
    piece of text sits in the first 100 or so of the 302 text positions)."""

    def __init__(self, tts: SpeechTokenModel, cache: SlotKVCache, device: torch.device,
                 max_rows: int = 64, width: int = PREFILL_TOKENS) -> None:
        self.tts = tts
        self.cache = cache
        rows = min(max_rows, cache.num_slots)
        dtype = next(tts.parameters()).dtype
        self.ids = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.valid = torch.zeros(rows, width, dtype=torch.bool, device=device)
        self.speaker_at = torch.zeros(rows, width, dtype=torch.bool, device=device)
        self.speaker = torch.zeros(rows, tts.config.hidden_size, dtype=dtype, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.buckets = bucket_sizes(rows)
        text_keys = text_key_count(tts.config, cache)
        self.spans = sorted({span for span in TEXT_PREFILL_SPANS if span < text_keys} | {text_keys})
        self.keys = [(b, span) for b in self.buckets for span in self.spans]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, object]] = {}

    def _forward(self, index: int) -> None:
        bucket, span = self.keys[index]
        text_prefill_step(self.tts, self.cache, self.ids[:bucket], self.positions[:bucket],
                          self.valid[:bucket], self.speaker[:bucket], self.speaker_at[:bucket],
                          self.slots[:bucket], False, span)

    def capture_all(self) -> None:
        graphs = capture_per_bucket(list(range(len(self.keys))), self._forward)
        self.graphs = {self.keys[i]: graph for i, graph in graphs.items()}

    def run(self, slots: list[int], ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
            speaker: torch.Tensor, speaker_at: torch.Tensor) -> None:
        """One pass for streams in ``slots``; the [B, width] inputs are on the CPU."""
        largest = self.buckets[-1]
        for start in range(0, len(slots), largest):
            part = slice(start, start + largest)
            count = len(slots[part])
            bucket = next(b for b in self.buckets if b >= count)
            device = self.ids.device
            self.valid[:bucket] = False
            self.speaker_at[:bucket] = False
            self.slots[:bucket] = slots[part][0]  # padding rows: a real slot, writes go to scratch
            # one host-to-device copy for all integer inputs of this pass
            packed = to_device(torch.cat([torch.tensor(slots[part])[:, None], ids[part],
                                          positions[part], valid[part].long(),
                                          speaker_at[part].long()], dim=1), device)
            width = ids.shape[1]
            self.slots[:count] = packed[:, 0]
            self.ids[:count] = packed[:, 1:1 + width]
            self.positions[:count] = packed[:, 1 + width:1 + 2 * width]
            self.valid[:count] = packed[:, 1 + 2 * width:1 + 3 * width].bool()
            self.speaker_at[:count] = packed[:, 1 + 3 * width:].bool()
            self.speaker[:count] = speaker[part]
            last = int(positions[part][valid[part]].max()) if bool(valid[part].any()) else 0
            self.graphs[(bucket, shortest_span(self.spans, last))][0].replay()

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
