"""One chat-mode LLM decode step for a batch of streams, graph-capturable.

Inputs are per-row tensors (last token, its position, sampling parameters, the ids the
repetition penalty looks at); the output is the next token of every row, sampled on the device
with transformers' order of processors: repetition penalty, temperature, top-k, top-p.
When every row's top-k is small the step samples from each row's largest logits only
(:func:`~.sampling.sample_candidates`), with the same result as over the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from ..model.layers import DecoderShape, SlotKVCache, StepInputs, causal_attend
from ..model.modeling import QwenLM
from ..voices import VoicePrefix
from .graphs import (
    bucket_sizes,
    capture_per_bucket,
    gathered_slots,
    row_bucket_sizes,
    separate_capture_stream,
    shortest_span,
)
from .sampling import (
    CANDIDATE_TOP_K,
    apply_repetition_penalty,
    sample_candidates,
    sample_full_vocabulary,
)
from .transfer import HostCopy, device_tensor, to_device

SAMPLING_PATHS = ("auto", "full", "candidates")
# The decode graphs sample from candidates from this many rows up: for one row the full path's
# sorts cost less than the candidates' passes over a whole row (H100, graph replay: 0.25 ms
# against 0.27; from 2 rows the candidates win, 64 rows: 0.73 ms against 3.2).
CANDIDATE_MIN_ROWS = 2


@dataclass
class LLMStepInputs:
    token: torch.Tensor        # [B] long, fed at ``position``
    position: torch.Tensor     # [B] long
    active: torch.Tensor       # [B] bool
    temperature: torch.Tensor  # [B] float (1.0 where greedy)
    top_p: torch.Tensor        # [B] float
    top_k: torch.Tensor        # [B] long
    penalty: torch.Tensor      # [B] float
    greedy: torch.Tensor       # [B] bool
    seed: torch.Tensor         # [B] long
    counter: torch.Tensor      # [B] long
    window: torch.Tensor       # [B, W] long (padded with repeats of its first id)

    def slice(self, count: int) -> "LLMStepInputs":
        return LLMStepInputs(**{f.name: getattr(self, f.name)[:count] for f in fields(self)})


def llm_decode_step(llm: QwenLM, cache: SlotKVCache, x: LLMStepInputs, rows: torch.Tensor,
                    contiguous: bool, path: str = "auto", key_count: int | None = None) -> torch.Tensor:
    """One decode step of rows ``rows`` of ``cache``; the next token per row, sampled along
    ``path`` (:func:`sample_next_token`). Attention reads the first ``key_count`` positions of
    the cache (default: all of it), which must hold every active row's ``position``."""
    return sample_next_token(llm_decode_logits(llm, cache, x, rows, contiguous, key_count), x, path)


def llm_decode_logits(llm: QwenLM, cache: SlotKVCache, x: LLMStepInputs, rows: torch.Tensor,
                      contiguous: bool, key_count: int | None = None) -> torch.Tensor:
    """:func:`llm_decode_step`'s forward pass: the rows' next-token logits [B, V] (their tokens'
    keys and values written into the cache)."""
    keys = torch.arange(cache.max_positions + 1 if key_count is None else key_count,
                        device=x.token.device)
    visible = keys[None, :] <= x.position[:, None]
    visible = torch.where(x.active[:, None], visible, keys[None, :] == 0)
    write = torch.where(x.active, x.position, torch.full_like(x.position, cache.scratch_position))
    # the same keys as two ranges (the second empty), for layers that attend by visible ranges
    seen = torch.where(x.active, x.position + 1, torch.ones_like(x.position))
    step = StepInputs(rows, x.position[:, None], write[:, None], visible[:, None, None, :],
                      contiguous, ranges=seen[:, None].expand(-1, 3))
    return llm.logits(llm.hidden_states(x.token[:, None], cache, step)[:, -1])


def sample_next_token(logits: torch.Tensor, x: LLMStepInputs, path: str = "auto") -> torch.Tensor:
    """Next token per row from LLM logits [B, V], with the rows' sampling parameters.

    ``path``: ``"full"`` runs top-k, top-p and the draw over the whole vocabulary;
    ``"candidates"`` over each row's ``CANDIDATE_TOP_K + 1`` largest logits, with -1 in the rows
    that cannot be exact that way (:func:`~.sampling.sample_candidates`); both are sync-free.
    ``"auto"`` (eager callers) takes the candidates where they are exact and the full path
    otherwise, reading on the host whether they are. Every path gives the same tokens.
    """
    if path not in SAMPLING_PATHS:
        raise ValueError(f"path must be one of {SAMPLING_PATHS}, not {path!r}")
    logits = apply_repetition_penalty(logits, x.window, x.penalty[:, None])
    logits = logits / x.temperature[:, None]
    args = (x.top_k[:, None], x.top_p[:, None], x.greedy, x.seed, x.counter * 7919 + 1)
    if path == "candidates" or (path == "auto" and int(x.top_k.max()) <= CANDIDATE_TOP_K):
        tokens = sample_candidates(logits, *args)
        if path == "candidates" or bool((tokens >= 0).all()):
            return tokens
    return sample_full_vocabulary(logits, *args)


def llm_key_spans(total: int) -> list[int]:
    """Key spans the LLM step graphs are captured for: 128, 256, 512, 1024, then steps of 1024,
    each at most half of ``total`` (the whole cache), and ``total`` itself. A step reads the
    shortest that holds its rows' positions: SDPA reads every key of the span for every row
    (2049 positions x 128 rows of Qwen2-7B are 15 GB, as much as its weights), while chat rows
    are mostly a few hundred positions long."""
    spans = [128, 256, 512] + list(range(1024, total, 1024))
    return sorted({s for s in spans if 2 * s <= total} | {total})


class LLMStepGraphs:
    """:func:`llm_decode_step` as CUDA graphs per batch bucket over LLM slots ``0..b-1`` and key
    span (:func:`llm_key_spans`): one that samples over the full vocabulary and, from
    ``CANDIDATE_MIN_ROWS`` rows up, one that samples from candidates (:func:`sample_next_token`).

    :meth:`run` knows every row's ``top_k`` on the host: when all are within
    ``CANDIDATE_TOP_K`` it replays the candidates graph, and only if a row comes back -1 (logits
    equal to its k-th largest run past the candidates) the full graph too, which recomputes the
    same step (rewriting the same keys and values) and samples over the whole vocabulary. The
    choice adds no sync: the tokens are copied to the host anyway.
    """

    def __init__(self, llm: QwenLM, cache: SlotKVCache, window: int, device: torch.device,
                 whole_span_only: bool = False, gathered: bool = False) -> None:
        self.llm = llm
        self.cache = cache
        self.gathered = gathered
        slots = cache.num_slots
        zeros = lambda dtype, *shape: torch.zeros(slots, *shape, dtype=dtype, device=device)  # noqa: E731
        self.inputs = LLMStepInputs(
            token=zeros(torch.long), position=zeros(torch.long), active=zeros(torch.bool),
            temperature=zeros(torch.float32) + 1, top_p=zeros(torch.float32) + 1,
            top_k=zeros(torch.long) + 1, penalty=zeros(torch.float32) + 1,
            greedy=zeros(torch.bool), seed=zeros(torch.long), counter=zeros(torch.long),
            window=zeros(torch.long, window))
        self.rows = torch.arange(slots, device=device)  # each row's slot (filled, if gathered)
        self._first_rows = torch.arange(slots, device=device)  # gathered: streams' rows, in order
        self.buckets = row_bucket_sizes(slots) if gathered else bucket_sizes(slots)
        # attention that reads only the keys each row sees needs no shorter spans
        self.spans = ([cache.max_positions + 1] if whole_span_only
                      else llm_key_spans(cache.max_positions + 1))
        # (bucket, span, path), the largest last: captured first into the shared pool
        self.keys = [(b, span, path) for b in self.buckets for span in self.spans
                     for path in ("full", "candidates")
                     if path == "full" or b >= CANDIDATE_MIN_ROWS]
        self.graphs: dict[tuple[int, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, index: int) -> torch.Tensor:
        bucket, span, path = self.keys[index]
        return llm_decode_step(self.llm, self.cache, self.inputs.slice(bucket), self.rows[:bucket],
                               not self.gathered, path, span)

    def shape(self, slots: list[int], x: LLMStepInputs) -> tuple[int, int]:
        """The batch bucket and key span a step of rows ``slots`` at positions ``x.position``
        replays: the smallest bucket that holds the rows (``gathered``) or past the highest
        slot (it computes every row below it), and the shortest span that holds every row's
        position."""
        rows = len(slots) if self.gathered else max(slots) + 1
        return (next(b for b in self.buckets if b >= rows),
                shortest_span(self.spans, int(x.position.max())))

    def capture_all(self, capture_stream: torch.cuda.Stream | None = None) -> None:
        """A capture stream of their own (``capture_stream``, default a new one): these graphs
        replay beside the audio window when the step is overlapped (launch), so they must not
        share its matmuls' cuBLAS workspace."""
        graphs = capture_per_bucket(list(range(len(self.keys))), self._forward,
                                    capture_stream=capture_stream or separate_capture_stream())
        self.graphs = {self.keys[i]: graph for i, graph in graphs.items()}

    def _place(self, slots: list[int], x: LLMStepInputs,
               shape: tuple[int, int] | None) -> tuple[tuple[int, int], torch.Tensor, str]:
        """Write the rows' inputs into the graphs' static inputs (current stream); the (bucket,
        span) to replay (``shape``, :meth:`shape`'s answer when the caller has it), the rows'
        index and the path to replay first."""
        shape = shape or self.shape(slots, x)
        self.inputs.active[:shape[0]] = False
        if self.gathered:  # row i is the i-th stream, its slot in the rows' index
            index = self._first_rows[:len(slots)]
            self.rows[:shape[0]] = to_device(gathered_slots(slots, shape[0]), self.rows.device)
        else:
            index = device_tensor(slots, self.rows.device)
        for f in fields(LLMStepInputs):
            getattr(self.inputs, f.name)[index] = to_device(getattr(x, f.name), self.rows.device)
        fast = (*shape, "candidates") in self.graphs and int(x.top_k.max()) <= CANDIDATE_TOP_K
        return shape, index, "candidates" if fast else "full"

    def run(self, slots: list[int], x: LLMStepInputs,
            shape: tuple[int, int] | None = None) -> torch.Tensor:
        shape, index, path = self._place(slots, x, shape)
        if path == "candidates":
            graph, out = self.graphs[(*shape, "candidates")]
            graph.replay()
            tokens = out[index].cpu()
            if bool((tokens >= 0).all()):
                return tokens
        return self._replay_full(shape, index)

    def _replay_full(self, shape: tuple[int, int], index: torch.Tensor) -> torch.Tensor:
        graph, out = self.graphs[(*shape, "full")]
        graph.replay()
        return out[index].cpu()

    def launch(self, slots: list[int], x: LLMStepInputs, stream: torch.cuda.Stream,
               shape: tuple[int, int] | None = None,
               after: torch.cuda.Event | None = None) -> "LaunchedStep":
        """Like :meth:`run` without waiting: on ``stream``, once the current stream's work
        queued so far has run (or, with ``after``, the current stream's work up to that
        event: what was queued since, an audio window, runs beside the step), the inputs are
        written and the graph replays, and its tokens are copied to the host (one launch in
        flight at a time; :meth:`collect` before the next)."""
        if after is None:
            stream.wait_stream(torch.cuda.current_stream(self.rows.device))
        else:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            shape, index, path = self._place(slots, x, shape)
            graph, out = self.graphs[(*shape, path)]
            graph.replay()
            tokens = HostCopy(out[index])  # the gather is made and freed on ``stream``
        return LaunchedStep(shape, index, path, tokens)

    def collect(self, launched: "LaunchedStep") -> torch.Tensor:
        """The launched step's tokens (waits for them); a candidates step with a row that could
        not be exact is recomputed over the full vocabulary, as :meth:`run` does."""
        tokens = launched.tokens.wait()
        if launched.path == "candidates" and not bool((tokens >= 0).all()):
            return self._replay_full(launched.shape, launched.index)
        return tokens


@dataclass
class LaunchedStep:
    """An LLM step in flight on a stream of its own (:meth:`LLMStepGraphs.launch`)."""

    shape: tuple[int, int]  # batch bucket and key span
    index: torch.Tensor
    path: str
    tokens: HostCopy


def llm_prefill(llm: QwenLM, cache: SlotKVCache, ids: torch.Tensor, valid: torch.Tensor,
                rows: torch.Tensor, contiguous: bool, starts: torch.Tensor | None = None,
                key_count: int | None = None, embeddings: torch.Tensor | None = None) -> torch.Tensor:
    """Causal prefill of prompts ``ids`` [B, L] (``valid`` marks real tokens, left-aligned) into
    ``cache`` rows ``rows`` at positions ``starts + 0..L-1``; returns the hidden states [B, L, H].

    ``starts`` [B] (default 0): a row's first ``starts`` positions already hold the keys and
    values of its prefix (a voice turn), which its tokens attend to. Attention reads the first
    ``key_count`` positions of the cache (default L; at least ``max(starts) + L``).
    ``embeddings`` [B, L, H] replaces the token embeddings of ``ids`` (audio placeholders)."""
    batch, length = ids.shape
    positions = torch.arange(length, device=ids.device).expand(batch, length)
    if starts is not None:
        positions = positions + starts[:, None]
    write = torch.where(valid, positions, torch.full_like(positions, cache.scratch_position))
    attend = causal_attend(positions, valid, length if key_count is None else key_count)
    step = StepInputs(rows, positions, write, attend, contiguous)
    if embeddings is None:
        return llm.hidden_states(ids, cache, step)
    return llm.hidden_states_of_embeddings(embeddings, cache, step)


def write_prefixes(cache: SlotKVCache, prefixes: Sequence[VoicePrefix | None]) -> None:
    """Row i of ``cache`` gets ``prefixes[i]``'s keys and values at its first positions."""
    for row, prefix in enumerate(prefixes):
        if prefix is not None:
            cache.write_prefix(row, prefix.keys, prefix.values)


class LLMPrefillGraphs:
    """:func:`llm_prefill` as CUDA graphs over a cache of its own, per (batch, prompt length,
    prefix length) bucket: admission prefills are a few prompts of tens to hundreds of tokens,
    and eager they cost more in kernel launches than in weight reads. A prompt in a cloned voice
    starts after its voice turn's keys and values, copied into its row before the replay; a
    prefix bucket only widens the keys attention reads. The caller copies the keys and values a
    chat stream keeps into its slot."""

    def __init__(self, llm: QwenLM, shape: DecoderShape, device: torch.device, dtype: torch.dtype,
                 max_batch: int = 8, lengths: tuple[int, ...] = (64, 128, 256, 512),
                 prefix_lengths: tuple[int, ...] = (0,)) -> None:
        self.llm = llm
        self.cache = SlotKVCache(shape, max_batch, max(prefix_lengths) + max(lengths), device, dtype)
        self.ids = torch.zeros(max_batch, max(lengths), dtype=torch.long, device=device)
        self.valid = torch.zeros(max_batch, max(lengths), dtype=torch.bool, device=device)
        self.starts = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.rows = torch.arange(max_batch, device=device)
        self.batches = bucket_sizes(max_batch)
        self.lengths = sorted(lengths)
        self.prefix_lengths = sorted(prefix_lengths)
        self.keys = [(b, n, p) for b in self.batches for n in self.lengths
                     for p in self.prefix_lengths]
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, index: int) -> torch.Tensor:
        batch, length, prefix = self.keys[index]
        return llm_prefill(self.llm, self.cache, self.ids[:batch, :length], self.valid[:batch, :length],
                           self.rows[:batch], True, self.starts[:batch], prefix + length)

    def capture_all(self, capture_stream: torch.cuda.Stream | None = None) -> None:
        """Captured on ``capture_stream`` (default: torch's default capture stream, whose
        cuBLAS workspace the audio window's graphs share): a stream of their own for graphs
        that replay beside the window (``prefill_beside_window``)."""
        graphs = capture_per_bucket(list(range(len(self.keys))), self._forward,
                                    capture_stream=capture_stream)
        self.graphs = {self.keys[i]: graph for i, graph in graphs.items()}

    def fits(self, count: int, longest: int, longest_prefix: int = 0) -> bool:
        return (count <= self.batches[-1] and longest <= self.lengths[-1]
                and longest_prefix <= self.prefix_lengths[-1])

    def run(self, ids: torch.Tensor, valid: torch.Tensor,
            prefixes: Sequence[VoicePrefix | None]) -> torch.Tensor:
        """``ids``/``valid`` [B, L] on the CPU and each row's voice prefix (within :meth:`fits`);
        returns hidden [B, L, H], valid until the next replay; keys and values (prefixes
        included) are in ``self.cache`` rows ``0..B-1``."""
        count, longest = ids.shape
        starts = [p.length if p is not None else 0 for p in prefixes]
        batch = next(b for b in self.batches if b >= count)
        length = next(n for n in self.lengths if n >= longest)
        prefix = next(p for p in self.prefix_lengths if p >= max(starts))
        self.ids[:batch, :length] = 0
        self.valid[:batch, :length] = False
        self.starts[:batch] = 0
        self.ids[:count, :longest] = to_device(ids, self.ids.device)
        self.valid[:count, :longest] = to_device(valid, self.ids.device)
        self.starts[:count] = device_tensor(starts, self.ids.device)
        write_prefixes(self.cache, prefixes)
        graph, out = self.graphs[(batch, length, prefix)]
        graph.replay()
        return out[:count, :longest]
