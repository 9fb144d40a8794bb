"""The model runner: the engine's device work, tensors in and tensors out.

It owns the KV caches and a per-slot table of speaker embeddings, turns host-side work items
into batched step inputs, and runs each step (the steps themselves are plain functions over
tensors: :mod:`.audio_step`, :mod:`.llm_step`, :mod:`.tts_prefill`, :mod:`.decode_graphs`).
:class:`ModelRunner` runs every step eagerly; :class:`~.graph_runner.GraphModelRunner` replays
captured CUDA graphs where it can. :func:`~.graph_runner.create_runner` makes that choice once,
when the engine starts.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import Sequence

import torch

from ..model.layers import SlotKVCache, fuse_projections, set_one_query_attention
from ..model.loader import LoadedModel
from ..model.quantization import warm_up_int4_kernels
from ..options import EngineOptions
from ..speech_schedule import TextPrefill
from ..voices import VoicePrefix, VoiceTurn, prefix_length
from .audio_step import AudioStepInputs, attention_span, audio_window
from .audio_step import key_count_buckets, window_key_reads
from .decode_graphs import DecodedAudio, queue_decode
from .packed_prefill import PackedPrompts, llm_packed_prefill
from .llm_step import (
    LLMStepInputs,
    llm_decode_step,
    llm_prefill,
    sample_next_token,
    write_prefixes,
)
from .transfer import HostCopy, device_tensor, to_device
from .tts_prefill import carry_prefill, text_prefill_passes, text_prefill_step

logger = logging.getLogger(__name__)


def fits_one_pass(lengths: Sequence[int], budget: int) -> bool:
    """Prompts of ``lengths`` fit one prefill pass of ``budget`` padded tokens (the prompts
    times the longest); a single prompt always does, however long."""
    return pass_fits(len(lengths), max(lengths, default=0), budget)


def pass_fits(prompts: int, longest: int, budget: int) -> bool:
    """:func:`fits_one_pass` from the count of prompts and the longest one's length."""
    return prompts <= 1 or prompts * longest <= budget


def last_index(ids: Sequence[int], token: int) -> int:
    """Where ``token`` last occurs in ``ids`` (a prompt's ``<|spk|>``)."""
    return max(i for i, t in enumerate(ids) if t == token)


class ModelRunner:
    """Eager steps over the slot caches (CPU, or a GPU with ``cuda_graphs`` off)."""

    def __init__(self, model: LoadedModel, options: EngineOptions, penalty_width: int) -> None:
        self.model = model
        self.device = next(model.tts.parameters()).device
        self.dtype = next(model.tts.parameters()).dtype
        cfg = model.config
        self.tts_cache = SlotKVCache(cfg.tts_shape(), options.max_slots, options.tts_max_positions,
                                     self.device, self.dtype, options.tts_kv_cache_dtype)
        self.llm_cache = SlotKVCache(cfg.llm, options.max_chat_slots, options.llm_max_positions,
                                     self.device, self.dtype)
        # written by the admission prefill, read by every text prefill of the slot's stream
        self.speakers = torch.zeros(options.max_slots, cfg.tts.hidden_size, device=self.device,
                                    dtype=self.dtype)
        self.one_query_attention = options.one_query_attention
        self.packed_prefill = options.packed_prefill  # admission prompts in one row
        # decode-step attention that reads only the key blocks (flex) or the keys each row sees,
        # whatever the span (layers.py)
        self.reads_only_visible = options.one_query_attention in ("flex", "visible_ranges")
        self.window = options.steps_per_sync
        self.spans = key_count_buckets(options.tts_max_positions + 1)
        # What the device was asked to do, by kind (benchmarks turn it into bytes moved per
        # phase; see bench/engine/measure.py): calls, rows computed (graph padding included),
        # and key positions attention read.
        self.work: collections.Counter = collections.Counter()
        self.decoder = model.decoder
        if options.fuse_projections:
            fuse_projections(model.tts)
            fuse_projections(model.llm)
        set_one_query_attention(model.tts, options.one_query_attention)
        # The chat LLM's decode step reads 15 GB of weights and little cache: flex would only
        # add a compile per captured shape to the start, so it keeps SDPA; visible_ranges gives
        # it the one kernel for rotary, cache write and attention (its rows' positions so far).
        self.llm_attention = ("sdpa" if options.one_query_attention == "flex"
                              else options.one_query_attention)
        set_one_query_attention(model.llm, self.llm_attention)
        if self.device.type == "cuda":
            self._warm_up_int4(model)

    @staticmethod
    def _warm_up_int4(model: LoadedModel) -> None:
        """Compile the int4 kernels for every row count now (quantization.py); a failure here
        only leaves them to compile on first use."""
        started = time.perf_counter()
        try:
            calls = warm_up_int4_kernels(model.llm)
        except Exception:  # an optimisation: serving works without it
            logger.exception("int4 kernel warm-up failed; kernels compile on first use")
            return
        if calls:
            logger.info("int4 kernels warmed up: %d calls in %.1f s", calls,
                        time.perf_counter() - started)

    def admission_stream(self, beside_window: bool) -> contextlib.AbstractContextManager:
        """Where an admission's prefill pass runs (a busy engine's, ``beside_window``: while
        the device runs the step's audio window); eager, in line."""
        return contextlib.nullcontext()

    def clear_tts_slot(self, slot: int) -> None:
        """Forget the text part of a slot's TTS cache (a new stream or a new segment)."""
        self.tts_cache.clear_slot(slot, upto=self.model.config.tts.condition_length)

    # ---- LLM ---------------------------------------------------------------------------------

    def prefill_prompts(self, prompts: Sequence[list[int]], voices: Sequence[VoicePrefix | None],
                        slots: Sequence[int], spk_id: int, chat_rows: Sequence[int],
                        llm_slots: Sequence[int]) -> torch.Tensor | None:
        """One LLM prefill of ``prompts`` (within :func:`fits_one_pass`), each after its voice's turn
        (``voices[i]``: its cached keys and values; None for the default voice): row i's speaker
        embedding (the hidden state at its last ``spk_id``) goes to TTS slot ``slots[i]``; rows
        ``chat_rows`` keep their keys and values (voice turn included) in LLM slots
        ``llm_slots`` and get their next-token logits."""
        if self.packed_prefill and all(voice is None for voice in voices):
            return self._prefill_packed(prompts, slots, spk_id, chat_rows, llm_slots)
        longest = max(len(p) for p in prompts)
        batch = len(prompts)
        ids = torch.zeros(batch, longest, dtype=torch.long)
        valid = torch.zeros(batch, longest, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            valid[i, : len(p)] = True
        hidden, cache = self.llm_prefill(ids, valid, voices)
        self.work.update(llm_prefill_passes=1, llm_prefill_tokens=int(valid.sum()))
        every = torch.arange(batch, device=self.device)
        spk_index = device_tensor([last_index(p, spk_id) for p in prompts], self.device)
        self._keep_speakers(hidden[every, spk_index], slots)
        if not chat_rows:
            return None
        # the chat prompts stay in their LLM slots for decoding: one copy per layer for all of
        # them (positions past a prompt's end are rewritten by decoding before any query sees them)
        rows = device_tensor(list(chat_rows), self.device)
        targets = device_tensor(list(llm_slots), self.device)
        longest_chat = max(prefix_length(voices[i]) + len(prompts[i]) for i in chat_rows)
        for source, target in ((cache.keys, self.llm_cache.keys), (cache.values, self.llm_cache.values)):
            for layer_source, layer_target in zip(source, target):
                layer_target[targets, :, :longest_chat] = layer_source[rows, :, :longest_chat]
        last = device_tensor([len(prompts[i]) - 1 for i in chat_rows], self.device)
        return self.model.llm.logits(hidden[rows, last])

    def _prefill_packed(self, prompts: Sequence[list[int]], slots: Sequence[int], spk_id: int,
                        chat_rows: Sequence[int], llm_slots: Sequence[int]) -> torch.Tensor | None:
        """:meth:`prefill_prompts` with the prompts packed into one row (``packed_prefill``,
        :mod:`.packed_prefill`): the same speaker embeddings, chat keys and values and
        first-token logits, from the real tokens only."""
        packed = PackedPrompts.of(prompts)
        hidden, cache = self.llm_packed(packed)
        self.work.update(llm_prefill_passes=1, llm_prefill_packed=1,
                         llm_prefill_tokens=len(packed.ids))
        spk_at = [start + last_index(p, spk_id) for start, p in zip(packed.starts, prompts)]
        self._keep_speakers(hidden[device_tensor(spk_at, self.device)], slots)
        if not chat_rows:
            return None
        # each chat prompt's keys and values, from its place in the row to its LLM slot's start:
        # one indexed copy for every layer
        slot_at, position_at, flat_at = [], [], []
        for row, llm_slot in zip(chat_rows, llm_slots):
            length, start = len(prompts[row]), packed.starts[row]
            slot_at += [llm_slot] * length
            position_at += range(length)
            flat_at += range(start, start + length)
        target = (device_tensor(slot_at, self.device), device_tensor(position_at, self.device))
        flat = device_tensor(flat_at, self.device)
        for store, source in ((self.llm_cache.all_keys, cache.all_keys),
                              (self.llm_cache.all_values, cache.all_values)):
            # [tokens, layers, kv_heads, head_dim] on both sides
            store[:, target[0], :, target[1]] = source[:, 0, :, flat].permute(2, 0, 1, 3)
        last = [packed.starts[row] + len(prompts[row]) - 1 for row in chat_rows]
        return self.model.llm.logits(hidden[device_tensor(last, self.device)])

    def _keep_speakers(self, spk_states: torch.Tensor, slots: Sequence[int]) -> None:
        """Each prompt's speaker embedding, from its hidden state at ``<|spk|>`` [N, H], into
        its TTS slot's row of the table the text prefills read."""
        speakers = self.model.tts.speaker_embedding(spk_states)
        self.speakers[device_tensor(list(slots), self.device)] = speakers

    def llm_packed(self, packed: PackedPrompts) -> tuple[torch.Tensor, SlotKVCache]:
        """Hidden states [T, H] of packed prompts and the one-row cache holding them."""
        total = len(packed.ids)
        cache = SlotKVCache(self.model.config.llm, 1, total, self.device, self.dtype)
        ids, positions, segment = (to_device(t, self.device)
                                   for t in (packed.ids, packed.positions, packed.segment))
        valid = torch.ones(total, dtype=torch.bool, device=self.device)
        return llm_packed_prefill(self.model.llm, cache, ids, positions, segment, valid), cache

    def llm_prefill(self, ids: torch.Tensor, valid: torch.Tensor,
                    voices: Sequence[VoicePrefix | None]) -> tuple[torch.Tensor, SlotKVCache]:
        """Hidden states [B, L, H] of prompts ``ids`` [B, L] (CPU), each after its voice's turn,
        and the cache holding them (voice turns included)."""
        batch, longest = ids.shape
        starts = [prefix_length(v) for v in voices]
        key_count = max(starts) + longest
        cache = SlotKVCache(self.model.config.llm, batch, key_count, self.device, self.dtype)
        write_prefixes(cache, voices)
        hidden = llm_prefill(self.model.llm, cache, to_device(ids, self.device),
                             to_device(valid, self.device), torch.arange(batch, device=self.device),
                             True, device_tensor(starts, self.device), key_count)
        return hidden, cache

    def prompt_embeddings(self, token_ids: Sequence[int], audio_positions: Sequence[int],
                          audio: torch.Tensor) -> torch.Tensor:
        """The LLM input embeddings [L, H] of ``token_ids`` with audio embeddings ``audio``
        [T, H] at ``audio_positions`` (the ``<unk>`` placeholders), in order."""
        ids = torch.tensor(list(token_ids), device=self.device)
        embeddings = self.model.llm.model.embed_tokens(ids)
        positions = torch.tensor(list(audio_positions), device=self.device, dtype=torch.long)
        embeddings[positions] = audio.to(self.device, embeddings.dtype)
        return embeddings

    def prefill_with_audio(self, token_ids: Sequence[int], audio_positions: Sequence[int],
                           audio: torch.Tensor) -> tuple[torch.Tensor, SlotKVCache]:
        """One prompt with audio embeddings at ``audio_positions`` (:meth:`prompt_embeddings`):
        hidden states [L, H] and the cache holding its keys and values (row 0). Eager, on a
        cache of its own: safe beside the step thread."""
        embeddings = self.prompt_embeddings(token_ids, audio_positions, audio)[None]
        ids = torch.tensor([list(token_ids)], device=self.device)
        cache = SlotKVCache(self.model.config.llm, 1, ids.shape[1], self.device, self.dtype)
        hidden = llm_prefill(self.model.llm, cache, ids, torch.ones_like(ids, dtype=torch.bool),
                             torch.zeros(1, dtype=torch.long, device=self.device), True,
                             embeddings=embeddings)
        return hidden[0], cache

    def voice_prefix(self, voice_id: str, turn: VoiceTurn, audio: torch.Tensor) -> VoicePrefix:
        """A voice turn's LLM keys and values, computed once for every request in the voice."""
        _, cache = self.prefill_with_audio(turn.token_ids, turn.audio_positions, audio)
        keys, values = cache.read_prefix(0, len(turn.token_ids))
        return VoicePrefix(voice_id, list(turn.token_ids), keys, values)

    def launch_first_tokens(self, logits: torch.Tensor, inputs: LLMStepInputs) -> object:
        """Sample chat streams' first tokens from prefill logits with the decode step's
        processors, without waiting for the device where it can; :meth:`collect_first_tokens`
        gives the tokens (eager: sampled at once)."""
        return sample_next_token(logits, self._on_device(inputs)).tolist()

    def collect_first_tokens(self, launched: object) -> list[int]:
        return launched  # type: ignore[return-value]

    def join_side_stream(self) -> None:
        """The current stream waits for the work left on a side stream (eager: none)."""

    def llm_step(self, slots: list[int], inputs: LLMStepInputs) -> list[int]:
        """One decode step of the chat streams in LLM ``slots``; their next tokens."""
        self._count_llm_step(len(slots), self.llm_cache.max_positions + 1, inputs)
        tokens = llm_decode_step(self.model.llm, self.llm_cache, self._on_device(inputs),
                                 device_tensor(slots, self.device), False).cpu()
        return tokens.tolist()

    def llm_launch(self, slots: list[int], inputs: LLMStepInputs,
                   beside_window: bool = False) -> object:
        """Start :meth:`llm_step` so that work queued after it may overlap it (with
        ``beside_window``, also the audio window queued last, before it); :meth:`llm_collect`
        gives its tokens. Eager, the step runs at once."""
        self.work.update(llm_launches=1)
        return self.llm_step(slots, inputs)

    def llm_collect(self, launched: object) -> list[int]:
        return launched  # type: ignore[return-value]

    def _count_llm_step(self, rows: int, span: int, inputs: LLMStepInputs) -> None:
        """An LLM step of ``rows`` rows (graph padding included) reading ``span`` keys each, or,
        attending by visible ranges, each row its positions so far."""
        reads = (int(inputs.position.sum()) + len(inputs.position)
                 if self.llm_attention == "visible_ranges" else rows * span)
        self.work.update(llm_steps=1, llm_rows=rows, llm_key_reads=reads)

    def _on_device(self, inputs: LLMStepInputs) -> LLMStepInputs:
        return LLMStepInputs(**{f: to_device(getattr(inputs, f), self.device)
                                for f in LLMStepInputs.__dataclass_fields__})

    # ---- TTS ---------------------------------------------------------------------------------

    def text_prefill(self, items: Sequence[tuple[int, TextPrefill]]) -> None:
        """Batched text prefills (TTS slot, work item): items of up to :data:`PREFILL_TOKENS`
        tokens in passes of that width, longer ones in passes of :data:`LONG_PREFILL_TOKENS`
        (causal, so a long prefill split in passes writes exactly what one pass would)."""
        spk_id = self.model.config.tts.spk_emb_token_id
        for slots, ids, positions, valid, speaker_at in text_prefill_passes(items, spk_id):
            speaker = self.speakers[device_tensor(slots, self.device)]
            self._text_prefill_pass(slots, ids, positions, valid, speaker, speaker_at)

    def _text_prefill_pass(self, slots: list[int], ids: torch.Tensor, positions: torch.Tensor,
                           valid: torch.Tensor, speaker: torch.Tensor, speaker_at: torch.Tensor) -> None:
        self._count_text_prefill(len(slots), valid)
        ids_t, positions_t, valid_t, speaker_at_t = (to_device(t, self.device)
                                                     for t in (ids, positions, valid, speaker_at))
        text_prefill_step(self.model.tts, self.tts_cache, ids_t, positions_t, valid_t, speaker,
                          speaker_at_t, device_tensor(slots, self.device), False)

    def _count_text_prefill(self, rows: int, valid: torch.Tensor) -> None:
        self.work.update(text_prefill_passes=1, text_prefill_tokens=int(valid.sum()),
                         text_prefill_key_reads=rows * (self.tts_cache.max_positions + 1))

    def carry_prefill(self, slot: int, frames: list[list[int]], text_len: int) -> None:
        """``[Ptts]`` and the carried frames (all but the last) into a new segment's cache."""
        self.work.update(carry_prefills=1, carry_prefill_tokens=len(frames))
        carry_prefill(self.model.tts, self.model.config.tts, self.tts_cache, slot, frames, text_len,
                      self.device)

    def launch_audio_window(self, slots: list[int], inputs: AudioStepInputs) -> HostCopy:
        """Queue up to ``steps_per_sync`` audio frames of the streams in TTS ``slots``; the
        copy's :meth:`~.transfer.HostCopy.wait` gives them, [steps, B, num_vq + 1] on the CPU
        (see :func:`~.audio_step.audio_window`). The host may work while the device runs it."""
        rows = device_tensor(slots, self.device)
        span = attention_span(inputs, self.window, self.spans)
        self._count_audio_window(len(slots), span, inputs)
        return HostCopy(audio_window(self.model.tts, self.tts_cache, inputs.to(self.device), rows,
                                     False, self.window, span))

    def _count_audio_window(self, rows: int, span: int, inputs: AudioStepInputs) -> None:
        """Count a window of ``rows`` (graph padding included) over ``span`` keys; attention
        that reads only what a row sees (flex, visible_ranges) reads less than the span
        (:func:`window_key_reads`)."""
        key_reads = window_key_reads(inputs, rows, self.window, span, self.one_query_attention,
                                     self.model.tts.config)
        self.work.update(audio_windows=1, audio_frame_steps=self.window,
                         audio_rows=rows * self.window, audio_key_reads=key_reads)

    def launch_decode(self, frames: Sequence[list[list[int]]]) -> DecodedAudio:
        """Queue DVAE + Vocos for each piece's code frames (one device-to-host copy of all the
        audio); :meth:`DecodedAudio.wait` gives each piece as float32 audio."""
        self.work.update(decode_calls=1, decode_frames=sum(len(f) for f in frames))
        return queue_decode(self.decoder, frames)
