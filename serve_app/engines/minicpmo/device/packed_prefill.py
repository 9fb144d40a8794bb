"""The admission prefill with its prompts packed into one row (``packed_prefill``).

The padded pass (:func:`~.llm_step.llm_prefill`) runs ``B x L`` tokens for ``B`` prompts of up
to ``L`` tokens, and its graphs round both up to a bucket: 13 prompts of 20-70 tokens are 16 x
128 = 2048 tokens for ~500 real ones. Here the prompts follow one another in one row and a
token attends to the tokens of its own prompt up to itself, each at its own rotary position, so
the pass computes the real tokens (rounded up to one length bucket) and nothing else, as
vLLM's and FlashInfer's varlen prefill do. Prompts after a cloned voice's turn (a prefix of
cached keys per row) stay on the padded pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..model.layers import DecoderShape, SlotKVCache, StepInputs
from ..model.modeling import QwenLM
from .graphs import capture_per_bucket
from .transfer import to_device

# Total prompt tokens the packed graphs are captured for (prefill_tokens bounds a pass's padded
# tokens, 4096 by default, and the real ones are fewer); a longer pass runs eagerly.
PACKED_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class PackedPrompts:
    """Prompts one after another: token ids [T], each token's rotary position [T] (from 0 in
    its prompt), its prompt's index [T], and where each prompt starts."""

    ids: torch.Tensor
    positions: torch.Tensor
    segment: torch.Tensor
    starts: list[int]

    @classmethod
    def of(cls, prompts: Sequence[list[int]]) -> "PackedPrompts":
        starts, total = [], 0
        for prompt in prompts:
            starts.append(total)
            total += len(prompt)
        return cls(ids=torch.tensor([t for p in prompts for t in p], dtype=torch.long),
                   positions=torch.cat([torch.arange(len(p)) for p in prompts]),
                   segment=torch.cat([torch.full((len(p),), i) for i, p in enumerate(prompts)]),
                   starts=starts)


def packed_attend(segment: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Visibility [1, 1, T, T] of packed tokens: a token sees its own prompt's tokens up to
    itself; a padding token (``valid`` False) sees token 0 only (its output is unused, but a
    query with no visible key would give NaN)."""
    index = torch.arange(segment.shape[0], device=segment.device)
    visible = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    visible = torch.where(valid[:, None], visible, index[None, :] == 0)
    return visible[None, None]


def llm_packed_prefill(llm: QwenLM, cache: SlotKVCache, ids: torch.Tensor,
                       positions: torch.Tensor, segment: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
    """Hidden states [T, H] of packed prompts (each [T]: ids, rotary positions, prompt index,
    real tokens); token t's keys and values go to row 0 of ``cache`` at position t (padding
    to its scratch position)."""
    flat = torch.arange(ids.shape[0], device=ids.device)
    write = torch.where(valid, flat, torch.full_like(flat, cache.scratch_position))
    step = StepInputs(torch.zeros(1, dtype=torch.long, device=ids.device), positions[None],
                      write[None], packed_attend(segment, valid), contiguous=True)
    return llm.hidden_states(ids[None], cache, step)[0]


class PackedPrefillGraphs:
    """:func:`llm_packed_prefill` as CUDA graphs per total length (:data:`PACKED_LENGTHS`)
    over a one-row cache of its own; padding tokens belong to no prompt."""

    def __init__(self, llm: QwenLM, shape: DecoderShape, device: torch.device,
                 dtype: torch.dtype, lengths: tuple[int, ...] = PACKED_LENGTHS) -> None:
        self.llm = llm
        self.lengths = sorted(lengths)
        longest = self.lengths[-1]
        self.cache = SlotKVCache(shape, 1, longest, device, dtype)
        self.ids = torch.zeros(longest, dtype=torch.long, device=device)
        self.positions = torch.zeros(longest, dtype=torch.long, device=device)
        self.segment = torch.full((longest,), -1, dtype=torch.long, device=device)
        self.valid = torch.zeros(longest, dtype=torch.bool, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, length: int) -> torch.Tensor:
        return llm_packed_prefill(self.llm, self.cache, self.ids[:length],
                                  self.positions[:length], self.segment[:length],
                                  self.valid[:length])

    def capture_all(self, capture_stream: torch.cuda.Stream | None = None) -> None:
        """Captured on ``capture_stream`` (as :class:`~.llm_step.LLMPrefillGraphs`)."""
        self.graphs = capture_per_bucket(self.lengths, self._forward,
                                         capture_stream=capture_stream)

    def fits(self, total: int) -> bool:
        return total <= self.lengths[-1]

    def run(self, packed: PackedPrompts) -> torch.Tensor:
        """Hidden states [T, H] of ``packed`` (within :meth:`fits`), valid until the next
        replay; keys and values in ``self.cache`` row 0."""
        total = packed.ids.shape[0]
        length = next(n for n in self.lengths if n >= total)
        self.segment[:length] = -1
        self.valid[:length] = False
        self.ids[:total] = to_device(packed.ids, self.ids.device)
        self.positions[:total] = to_device(packed.positions, self.ids.device)
        self.segment[:total] = to_device(packed.segment, self.ids.device)
        self.valid[:total] = True
        graph, out = self.graphs[length]
        graph.replay()
        return out[:total]
