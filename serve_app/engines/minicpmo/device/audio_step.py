"""TTS audio steps for a batch of streams, as pure tensor functions.

Everything from the per-row inputs (:class:`AudioStepInputs`) to the sampled codes happens here (embedding,
attention mask, decoder, heads, temperature, top-p/top-k, end-of-audio rule, sampling), so the
whole step replays as one CUDA graph and the host only copies a small int tensor in and the
codes out. :func:`audio_window` chains several steps on the device (a frame's codes are the
next step's input), so the host syncs once per window instead of once per frame.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ..model.flex_attention import FLEX_KEY_BLOCK
from ..model.layers import SlotKVCache, StepInputs
from ..model.range_attention import ranges_mask
from ..model.modeling import SpeechTokenModel, TTSConfig
from .graphs import (
    bucket_sizes,
    capture_per_bucket,
    gathered_slots,
    row_bucket_sizes,
    shortest_span,
)
from .sampling import sample_or_argmax, top_k_filter, top_p_filter
from .transfer import HostCopy, to_device

if TYPE_CHECKING:
    from ..speech_schedule import AudioStep

TTS_TEMPERATURE = (0.1, 0.3, 0.1, 0.3)
TTS_MIN_KEEP = 3


@dataclass
class AudioStepInputs:
    """Per-row inputs of an audio step: int64 [B] each, ``frame`` [B, num_vq].

    ``active``, ``bos``, ``warp`` and ``greedy`` are 0 or 1. ``call_frames``: frames already made
    in the current generate call; end-of-audio is allowed once it reaches ``eos_after``;
    ``steps_left``: frames the call may still make (its end, the frame limit, or the cache size).
    """

    active: torch.Tensor
    bos: torch.Tensor
    frame: torch.Tensor
    position: torch.Tensor
    text_len: torch.Tensor
    call_frames: torch.Tensor
    eos_after: torch.Tensor
    warp: torch.Tensor
    seed: torch.Tensor
    counter: torch.Tensor
    greedy: torch.Tensor
    steps_left: torch.Tensor

    @classmethod
    def from_steps(cls, steps: Sequence[AudioStep], seeds: Sequence[int], counters: Sequence[int],
                   greedy: bool, num_vq: int) -> "AudioStepInputs":
        """The batch of the streams' next steps (as their schedules give them), on the CPU: the
        streams' ints in :meth:`pack`'s layout, read into one array by numpy (0.3 ms at 850
        streams on a 2-core x86 box, where a tensor per field took 1.1 ms), viewed by field."""
        zeros = [0] * num_vq
        flag = int(greedy)
        values = itertools.chain.from_iterable(
            (1, int(st.bos), *(zeros if st.frame is None else st.frame), st.position, st.text_len,
             st.call_frames, st.eos_after, int(st.apply_warpers), seed, counter, flag,
             st.steps_left) for st, seed, counter in zip(steps, seeds, counters))
        columns = packed_columns(num_vq)
        packed = np.fromiter(values, dtype=np.int64, count=len(steps) * columns)
        return cls.unpack(torch.from_numpy(packed).view(len(steps), columns), num_vq)

    def pack(self) -> torch.Tensor:
        """All fields as one [B, columns] tensor, in field order: one copy moves a whole batch."""
        rows = self.position.shape[0]
        return torch.cat([getattr(self, f.name).reshape(rows, -1) for f in fields(self)], dim=1)

    @classmethod
    def unpack(cls, packed: torch.Tensor, num_vq: int) -> "AudioStepInputs":
        """Views of the columns of a tensor made by :meth:`pack`."""
        views, column = {}, 0
        for f in fields(cls):
            if f.name == "frame":
                views[f.name] = packed[:, column:column + num_vq]
                column += num_vq
            else:
                views[f.name] = packed[:, column]
                column += 1
        return cls(**views)

    def to(self, device: torch.device) -> "AudioStepInputs":
        """The same inputs on ``device``, moved by one copy."""
        return AudioStepInputs.unpack(self.pack().to(device), self.frame.shape[1])


def packed_columns(num_vq: int) -> int:
    """Width of a row made by :meth:`AudioStepInputs.pack`."""
    return len(fields(AudioStepInputs)) - 1 + num_vq


def _hidden_text_from(past: torch.Tensor, cfg: TTSConfig) -> torch.Tensor:
    """The first reserved text position still hidden from an audio query at cache length
    ``past``: 10 more are released every 50 audio positions (up to ``[Ptts]``, hidden with them)."""
    chunks = torch.div(past - cfg.streaming_text_reserved_len + cfg.streaming_audio_chunk_size - 1,
                       cfg.streaming_audio_chunk_size, rounding_mode="floor")
    return torch.clamp(chunks * cfg.streaming_text_chunk_size,
                       max=cfg.streaming_text_reserved_len) + cfg.text_start


def audio_visibility(keys: torch.Tensor, limit: torch.Tensor, past: torch.Tensor,
                     text_len: torch.Tensor, cfg: TTSConfig) -> torch.Tensor:
    """[B, T] keys an audio query may see (docs/minicpmo.md, "Attention in the TTS model").

    ``limit``: last visible position (causal); ``past``: cache length that decides how much
    reserved text is released; ``text_len``: L of the text mask.
    """
    hidden_from = _hidden_text_from(past, cfg)
    keys = keys[None, :]
    in_text = keys < cfg.condition_length
    text_visible = (keys <= (text_len[:, None] + cfg.text_start)) | (keys == cfg.audio_bos_position)
    visible = (keys <= limit[:, None]) & (~in_text | text_visible)
    return visible & ~((keys >= hidden_from[:, None]) & (keys <= cfg.audio_bos_position))


def audio_visible_ranges(limit: torch.Tensor, past: torch.Tensor, text_len: torch.Tensor,
                         cfg: TTSConfig) -> torch.Tensor:
    """The keys :func:`audio_visibility` marks, as two ranges per row: [..., 3] of (a_end,
    b_start, b_end), row i seeing ``[0, a_end)`` (the released, written text and the tokens
    before it) and ``[b_start, b_end)`` (``[Ptts]`` when it is not hidden, then the audio up
    to ``limit``), as :mod:`~..model.range_attention` reads them."""
    hidden_from = _hidden_text_from(past, cfg)
    text_end = torch.minimum(torch.minimum(text_len + cfg.text_start + 1, hidden_from),
                             torch.clamp(limit + 1, max=cfg.audio_bos_position)).clamp(min=0)
    ptts_seen = hidden_from > cfg.audio_bos_position
    audio_start = torch.where(ptts_seen, cfg.audio_bos_position, cfg.condition_length)
    return torch.stack([text_end, audio_start, limit + 1], dim=-1)


def audio_logits(tts: SpeechTokenModel, cache: SlotKVCache, x: AudioStepInputs,
                 rows: torch.Tensor, contiguous: bool, key_count: int | None = None) -> torch.Tensor:
    """Each row's next-frame logits [B, num_vq, codes] (float32) from its input (``[Ptts]`` or
    its last frame), which is written into the cache (:func:`audio_step` samples from them).

    Attention reads the first ``key_count`` cache positions (all by default; every active
    row's position must be below it). Inactive rows write to the scratch position and see
    only key 0; their logits are garbage.
    """
    cfg = tts.config
    active = x.active.bool()
    bos = x.bos.bool()
    frames = x.frame
    position = x.position
    bos_ids = torch.full_like(position, cfg.audio_bos_token_id)
    embeds = torch.where(bos[:, None], tts.emb_text(bos_ids), tts.code_embedding(frames))[:, None]
    # the keys each row sees as two ranges (inactive rows (0, 0, 0) -> (1, 0, 0): key 0 only),
    # and as the mask over the first key_count positions that the other kernels read
    ranges = audio_visible_ranges(position, position, x.text_len, cfg) * active[:, None]
    ranges = torch.cat([ranges[:, :1].clamp(min=1), ranges[:, 1:]], dim=1)
    visible = ranges_mask(ranges, key_count or cache.max_positions + 1)
    write = torch.where(active, position, torch.full_like(position, cache.scratch_position))
    step = StepInputs(rows, position[:, None], write[:, None], visible, contiguous, ranges=ranges)
    hidden = tts(embeds, cache, step)
    return tts.code_logits(hidden[:, -1])


def audio_step(tts: SpeechTokenModel, cache: SlotKVCache, x: AudioStepInputs,
               rows: torch.Tensor, contiguous: bool, key_count: int | None = None) -> torch.Tensor:
    """Advance each row one audio frame (:func:`audio_logits`, then upstream's temperature,
    top-p/top-k, end-of-audio rule and sampling); returns codes [B, num_vq]. Inactive rows'
    codes are garbage."""
    cfg = tts.config
    device = x.position.device
    batch = x.position.shape[0]
    logits = audio_logits(tts, cache, x, rows, contiguous, key_count)
    # (0.1, 0.3, 0.1, 0.3) built on device: no host copy may happen inside a CUDA graph
    codebooks = torch.arange(cfg.num_vq, device=device)
    temperature = torch.where(codebooks % 2 == 0, TTS_TEMPERATURE[0], TTS_TEMPERATURE[1])
    flat = (logits / temperature[None, :, None]).reshape(batch * cfg.num_vq, -1)
    rows_per_code = lambda values: values.repeat_interleave(cfg.num_vq)  # noqa: E731
    top_p = torch.full((flat.shape[0], 1), cfg.top_p, device=device)
    top_k = torch.full((flat.shape[0], 1), cfg.top_k, device=device, dtype=torch.long)
    warped = top_k_filter(top_p_filter(flat, top_p, TTS_MIN_KEEP), top_k, TTS_MIN_KEEP)
    flat = torch.where(rows_per_code(x.warp).bool()[:, None], warped, flat)
    eos_allowed = rows_per_code(x.call_frames) >= rows_per_code(x.eos_after)
    eos_column = flat[:, cfg.eos_code]
    flat[:, cfg.eos_code] = torch.where(eos_allowed, eos_column, torch.full_like(eos_column, float("-inf")))
    codebook = torch.arange(cfg.num_vq, device=device).repeat(batch)
    codes = sample_or_argmax(flat, rows_per_code(x.greedy).bool(), rows_per_code(x.seed) + 1_000_003,
                             rows_per_code(x.counter) * 8 + codebook)
    return codes.view(batch, cfg.num_vq)


def audio_window(tts: SpeechTokenModel, cache: SlotKVCache, x: AudioStepInputs,
                 rows: torch.Tensor, contiguous: bool, steps: int,
                 key_count: int | None = None) -> torch.Tensor:
    """Up to ``steps`` audio steps per row without the host: returns [steps, B, num_vq + 1],
    each frame's codes and, in the last column, 1 where the row really made that frame.

    After each step a row feeds its codes back as the next input; it stops (turns inactive,
    writing only to the scratch position) once its call has no ``steps_left`` or it sampled the
    end-of-audio code. The per-row rules are those of :class:`~.speech_schedule.SpeechSchedule`, which
    replays the made frames on the host afterwards.
    """
    eos_code = tts.config.eos_code
    frames = []
    for _ in range(steps):
        made = x.active
        codes = audio_step(tts, cache, x, rows, contiguous, key_count)
        frames.append(torch.cat([codes, made[:, None]], dim=1))
        ended = (codes == eos_code).any(dim=1) & (x.call_frames >= x.eos_after)
        still = (made.bool() & (x.steps_left > 1) & ~ended).long()
        x = AudioStepInputs(active=still, bos=torch.zeros_like(made), frame=codes,
                            position=x.position + 1, text_len=x.text_len,
                            call_frames=x.call_frames + 1, eos_after=x.eos_after,
                            warp=torch.ones_like(made), seed=x.seed, counter=x.counter + 1,
                            greedy=x.greedy, steps_left=x.steps_left - 1)
    return torch.stack(frames)


def key_count_buckets(total: int) -> list[int]:
    """Attention spans the audio graphs are captured for: 512, 768, 1024, then steps of 512,
    up to ``total`` (the whole cache) itself."""
    spans = [512, 768] + list(range(1024, total, 512))
    return sorted({s for s in spans if s < total} | {total})


def attention_span(x: AudioStepInputs, steps: int, spans: list[int]) -> int:
    """The shortest of ``spans`` that holds every row's last position in a window of ``steps``."""
    return shortest_span(spans, int(x.position.max()) + steps - 1)


def window_key_reads(x: AudioStepInputs, rows: int, steps: int, span: int, kernel: str,
                     cfg: TTSConfig) -> int:
    """Key positions a window of ``steps`` over ``rows`` rows (graph padding included) reads
    at attention span ``span`` with one-query attention ``kernel``. ``flex`` reads at most each
    stream's own key blocks up to its last position in the window, ``visible_ranges`` exactly
    the keys each row sees (a padding row: one), both whatever the span; the others read the
    whole span for every row. ``x`` on the CPU."""
    if kernel == "flex":
        block = FLEX_KEY_BLOCK
        last = (x.position + steps).clamp(max=span)
        return int(((last + block - 1) // block * block).sum()) * steps
    if kernel == "visible_ranges":
        position = x.position[None, :] + torch.arange(steps)[:, None]  # [steps, B]
        ranges = audio_visible_ranges(position, position, x.text_len[None, :], cfg)
        seen = ranges[..., 0] + (ranges[..., 2] - ranges[..., 1]).clamp(min=0)
        return int(seen.sum()) + (rows - x.position.shape[0]) * steps
    return rows * steps * span


class AudioStepGraphs:
    """:func:`audio_window` captured as CUDA graphs, one per batch-size bucket and attention span.

    ``gathered`` (for attention that addresses the cache by each row's slot, the
    ``visible_ranges`` kernel): row ``i`` of a bucket is the ``i``-th generating stream, its slot
    in a static index the launch fills, and the bucket the smallest that holds the generating
    streams (:func:`~.graphs.row_bucket_sizes`); padding rows are inactive (they point at the
    first stream's slot, write only its scratch position and read its key 0). Otherwise a
    bucket of size ``b`` steps slots ``0..b-1`` (slots are handed out lowest first, so the busy
    ones stay packed) and every stream below the highest generating one is a row, padding if
    it is not generating: at 576 read + 192 chat streams on an H200 the windows computed 1.62
    rows per frame of audio made (1.07 gathered), since slots freed and taken again spread the
    streams over 1024 (``docs/benchmarks/README.md``, "The audio window's rows"). The span is
    the shortest that holds every row's last position of the window, so attention does not
    read the empty end of the cache.
    """

    def __init__(self, tts: SpeechTokenModel, cache: SlotKVCache, device: torch.device,
                 steps: int = 1, whole_span_only: bool = False, gathered: bool = False) -> None:
        self.tts = tts
        self.gathered = gathered
        self.cache = cache
        self.steps = steps
        slots = cache.num_slots
        self.num_vq = tts.config.num_vq
        columns = packed_columns(self.num_vq)
        self.packed = torch.zeros(slots, columns, device=device, dtype=torch.long)
        self.rows = torch.arange(slots, device=device)  # each row's slot (filled, if gathered)
        self.buckets = row_bucket_sizes(slots) if gathered else bucket_sizes(slots)
        # Attention that skips the key blocks each row cannot see (flex) needs no shorter spans:
        # one graph per batch bucket, a quarter of the captures (each a compile, for flex).
        self.spans = ([cache.max_positions + 1] if whole_span_only
                      else key_count_buckets(cache.max_positions + 1))
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture_all(self) -> None:
        keyed = [(b, span) for b in self.buckets for span in self.spans]
        graphs = capture_per_bucket(
            list(range(len(keyed))),
            lambda i: audio_window(self.tts, self.cache,
                                   AudioStepInputs.unpack(self.packed[:keyed[i][0]], self.num_vq),
                                   self.rows[:keyed[i][0]], not self.gathered, self.steps,
                                   keyed[i][1]))
        self.graphs = {keyed[i]: graph for i, graph in graphs.items()}

    def shape(self, slots: list[int], x: AudioStepInputs) -> tuple[int, int]:
        """The (batch bucket, attention span) whose graph runs these streams."""
        rows = len(slots) if self.gathered else max(slots) + 1
        return (next(b for b in self.buckets if b >= rows),
                attention_span(x, self.steps, self.spans))

    def launch(self, slots: list[int], x: AudioStepInputs,
               shape: tuple[int, int] | None = None) -> HostCopy:
        """Inputs ``x`` (CPU) of the streams in ``slots``; queues the window and its copy to
        the host, [steps, B, vq + 1] as :func:`audio_window`, without waiting for either.
        ``shape``: :meth:`shape`'s answer, when the caller has it."""
        bucket, span = shape or self.shape(slots, x)
        self.packed[:bucket] = to_device(window_inputs(slots, x, bucket, self.gathered),
                                         self.packed.device)
        if self.gathered:
            self.rows[:bucket] = to_device(gathered_slots(slots, bucket), self.rows.device)
        graph, out = self.graphs[(bucket, span)]
        graph.replay()
        return HostCopy(out[:, :len(slots)] if self.gathered
                        else out[:, to_device(torch.tensor(slots), out.device)])


def window_inputs(slots: list[int], x: AudioStepInputs, bucket: int,
                  gathered: bool) -> torch.Tensor:
    """A window graph's packed inputs, [bucket, columns]: the streams' in order (``gathered``)
    or each in its slot's row; zeros (inactive rows) elsewhere."""
    rows = torch.zeros(bucket, packed_columns(x.frame.shape[1]), dtype=torch.long)
    rows[slice(0, len(slots)) if gathered else torch.tensor(slots)] = x.pack()
    return rows
