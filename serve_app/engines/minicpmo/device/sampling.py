"""Batched, sync-free sampling with per-row parameters and per-request seeds.

Noise comes from a counter-based hash of (seed, step, index), so a seeded stream draws the same
numbers whichever batch it runs in, and nothing waits on the host (CUDA-graph friendly).
The chat LLM's rows are sampled from their largest logits where their top-k allows
(:func:`sample_candidates`), with the tokens the whole vocabulary gives
(:func:`sample_full_vocabulary`).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hashed_uniform(seeds: torch.Tensor, counters: torch.Tensor, size: int) -> torch.Tensor:
    """Uniform (0, 1] noise [B, size] from splitmix64 of (seed, counter, index)."""
    index = torch.arange(size, device=seeds.device, dtype=torch.int64)
    return hashed_uniform_at(seeds, counters, index[None, :])


def hashed_uniform_at(seeds: torch.Tensor, counters: torch.Tensor,
                      index: torch.Tensor) -> torch.Tensor:
    """The noise of :func:`hashed_uniform` at the indices ``index`` [B, N] or [1, N] only: entry
    [b, j] equals ``hashed_uniform(seeds, counters, size)[b, index[b, j]]`` bit for bit (the
    same integer and float operations, element by element).

    The mantissa's 53 bits are rounded to float32, so a draw can be exactly 1.0 (about one in
    2**25).
    """
    x = seeds[:, None] * _GOLDEN + counters[:, None] * _MIX1 + index * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    mantissa = _shift_right(x, 11).to(torch.float64)
    return ((mantissa + 0.5) / float(1 << 53)).to(torch.float32)


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor, min_keep: int,
                 stable: bool = False) -> torch.Tensor:
    """transformers' TopPLogitsWarper with a per-row ``top_p`` [B, 1].

    Equal logits straddling the cut are removed in the order the ascending sort puts them:
    ``stable`` sorts equal logits by index (lowest first, so lowest removed first), which is what
    the CUDA sort does anyway for rows longer than 32 entries; the CPU's unstable sort orders
    them arbitrarily.
    """
    sorted_logits, sorted_index = torch.sort(logits, descending=False, dim=-1, stable=stable)
    remove = top_p_removed(sorted_logits, top_p, min_keep)
    remove = remove.scatter(-1, sorted_index, remove)
    return logits.masked_fill(remove, float("-inf"))


def top_p_removed(ascending: torch.Tensor, top_p: torch.Tensor, min_keep: int) -> torch.Tensor:
    """Which entries of rows sorted ascending top-p removes: those whose cumulative probability
    stays within ``1 - top_p``, but never the last ``min_keep``."""
    remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    remove[..., -min_keep:] = False
    return remove


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor, min_keep: int) -> torch.Tensor:
    """transformers' TopKLogitsWarper with a per-row ``top_k`` [B, 1]."""
    k = torch.clamp(top_k, min=min_keep, max=logits.shape[-1])
    sorted_logits = torch.sort(logits, descending=True, dim=-1).values
    threshold = sorted_logits.gather(-1, k - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def sample_or_argmax(logits: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
                     counters: torch.Tensor) -> torch.Tensor:
    """Per row: argmax where ``greedy`` [B] else a draw from softmax(logits) (Gumbel-max).

    ``logits`` [B, N] (already temperature-scaled and filtered). Entries at -inf (filtered out)
    stay at -inf: a draw of exactly 1.0 gives +inf noise, and -inf + inf would be NaN, which
    ``argmax`` would pick. Ties go to the lowest index.
    """
    index = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    return sample_or_argmax_at(logits, index, greedy, seeds, counters)


def sample_or_argmax_at(logits: torch.Tensor, index: torch.Tensor, greedy: torch.Tensor,
                        seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """:func:`sample_or_argmax` of rows that are -inf except at the distinct indices ``index``
    [B, N], where they hold ``logits`` [B, N]; returns the chosen indices (from ``index``).

    The noise at an index is the noise the whole row gets there (:func:`hashed_uniform_at`), and
    ties go to the lowest index, so the result is :func:`sample_or_argmax` of the whole row.
    A row with nothing above -inf gets index 0, as ``argmax`` gives it.
    """
    uniform = hashed_uniform_at(seeds, counters, index)
    gumbel = -torch.log(-torch.log(uniform))
    keep = greedy[:, None] | (logits == float("-inf"))
    noisy = torch.where(keep, logits, logits + gumbel)
    best = noisy.max(dim=-1, keepdim=True).values
    lowest = torch.where(noisy == best, index, torch.iinfo(torch.int64).max).min(dim=-1).values
    return torch.where(best[:, 0] == float("-inf"), torch.zeros_like(lowest), lowest)


def apply_repetition_penalty(logits: torch.Tensor, window: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor over ids ``window`` [B, W] (per-row penalty).

    A window shorter than W is padded by repeating one of its ids: scattering the same
    penalised score twice changes nothing.
    """
    scores = logits.gather(-1, window)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(-1, window, penalised)


CANDIDATE_TOP_K = 1024
"""The largest ``top_k`` :func:`sample_candidates` serves by default: it looks at a row's
``CANDIDATE_TOP_K + 1`` largest logits, the extra one showing whether logits equal to the k-th
largest (all of which ``top_k`` keeps) run past the candidates."""


def sample_full_vocabulary(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           greedy: torch.Tensor, seeds: torch.Tensor,
                           counters: torch.Tensor) -> torch.Tensor:
    """The chat LLM's top-k, top-p (``min_keep`` 1, ties cut in index order) and draw
    (:func:`sample_or_argmax`) over whole rows ``logits`` [B, V]; ``top_k``/``top_p`` [B, 1].

    Two sorts of [B, V] and noise for every entry: :func:`sample_candidates` gives the same
    tokens from far less.
    """
    logits = top_k_filter(logits, top_k, 1)
    logits = top_p_filter(logits, top_p, 1, stable=True)
    return sample_or_argmax(logits, greedy, seeds, counters)


def top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`top_k_filter` then :func:`top_p_filter` (``min_keep`` 1, ``stable``) of rows
    ``logits`` [B, V], from each row's ``n = min(count, V)`` largest entries.

    Returns the candidates in the order top-p sorts them (ascending, equal values by index):
    their filtered logits [B, n] (-inf where removed) and their indices [B, n]; and
    ``complete`` [B], true where every entry top-k keeps is a candidate, so that the candidates
    hold the whole filtered row (every other entry is -inf there). It is false where
    ``top_k >= n`` (n < V), or where entries equal to the k-th largest run past the candidates.

    Exactness: the k-th largest value is the same (the candidates hold the ``n`` largest values);
    top-p's softmax and cumulative sum run over a whole row of V entries, -inf but for the
    sorted survivors at its end, which is the row the full path sorts into, so both compute the
    same floats in the same order whatever the kernels' reduction order.
    """
    batch, size = logits.shape
    n = min(count, size)
    values, index = logits.topk(n, dim=-1, sorted=False)
    by_index, order = index.sort(dim=-1)
    ascending, position = values.gather(-1, order).sort(dim=-1, stable=True)
    index = by_index.gather(-1, position)
    threshold = ascending.gather(-1, n - torch.clamp(top_k, min=1, max=n))
    if n == size:
        complete = torch.ones(batch, dtype=torch.bool, device=logits.device)
    else:
        complete = ascending[:, 0] < threshold[:, 0]
    ascending = ascending.masked_fill(ascending < threshold, float("-inf"))
    row = logits.new_full((batch, size), float("-inf"))
    row[:, size - n:] = ascending
    remove = top_p_removed(row, top_p, 1)[:, size - n:]
    return ascending.masked_fill(remove, float("-inf")), index, complete


def sample_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      greedy: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                      max_top_k: int = CANDIDATE_TOP_K) -> torch.Tensor:
    """:func:`sample_full_vocabulary`'s tokens, from each row's ``max_top_k + 1`` largest logits
    (:func:`top_k_top_p_candidates`, :func:`sample_or_argmax_at`); -1 in the rows where that
    cannot be exact (``top_k > max_top_k``, or logits equal to the k-th largest past the
    candidates), which the caller samples with :func:`sample_full_vocabulary`. Sync-free.
    """
    filtered, index, complete = top_k_top_p_candidates(logits, top_k, top_p, max_top_k + 1)
    tokens = sample_or_argmax_at(filtered, index, greedy, seeds, counters)
    return torch.where(complete, tokens, torch.full_like(tokens, -1))
