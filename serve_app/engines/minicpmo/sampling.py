"""Batched, sync-free sampling with per-row parameters and per-request seeds.

Noise comes from a counter-based hash of (seed, step, index), so a seeded stream draws the same
numbers whichever batch it runs in, and nothing waits on the host (CUDA-graph friendly).
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
    """Uniform (0, 1) noise [B, size] from splitmix64 of (seed, counter, index)."""
    index = torch.arange(size, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _GOLDEN + counters[:, None] * _MIX1 + index[None, :] * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    mantissa = _shift_right(x, 11).to(torch.float64)
    return ((mantissa + 0.5) / float(1 << 53)).to(torch.float32)


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor, min_keep: int) -> torch.Tensor:
    """transformers' TopPLogitsWarper with a per-row ``top_p`` [B, 1]."""
    sorted_logits, sorted_index = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -min_keep:] = False
    remove = remove.scatter(-1, sorted_index, remove)
    return logits.masked_fill(remove, float("-inf"))


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor, min_keep: int) -> torch.Tensor:
    """transformers' TopKLogitsWarper with a per-row ``top_k`` [B, 1]."""
    k = torch.clamp(top_k, min=min_keep, max=logits.shape[-1])
    sorted_logits = torch.sort(logits, descending=True, dim=-1).values
    threshold = sorted_logits.gather(-1, k - 1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def sample_or_argmax(logits: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
                     counters: torch.Tensor) -> torch.Tensor:
    """Per row: argmax where ``greedy`` [B] else a draw from softmax(logits) (Gumbel-max).

    ``logits`` [B, N] (already temperature-scaled and filtered).
    """
    uniform = hashed_uniform(seeds, counters, logits.shape[-1])
    gumbel = -torch.log(-torch.log(uniform))
    noisy = torch.where(greedy[:, None], logits, logits + gumbel)
    return noisy.argmax(dim=-1)


def apply_repetition_penalty(logits: torch.Tensor, window: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor over ids ``window`` [B, W] (per-row penalty).

    A window shorter than W is padded by repeating one of its ids: scattering the same
    penalised score twice changes nothing.
    """
    scores = logits.gather(-1, window)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(-1, window, penalised)
