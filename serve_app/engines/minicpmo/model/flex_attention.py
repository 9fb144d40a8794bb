"""FlexAttention for one query per row: a row reads only the key blocks it can see (the
``flex`` choice of :func:`.layers.set_one_query_attention`)."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

FLEX_KEY_BLOCK = 128  # keys per block of the flex block mask (FlexAttention's default)
# Compiled shapes the flex kernel may have: one per captured batch bucket and attention span
# (tens in the engine), far above dynamo's default of 8 recompiles per function.
FLEX_COMPILED_SHAPES = 512


@functools.cache
def _flex_kernel():
    """:func:`_flex_one_query` compiled where FlexAttention runs as a fused kernel (CUDA). The
    block mask comes in built (once per decode step, shared by every layer: built in each
    layer, its reduction and sort took 2.4 ms of a 55-65 ms step at 384 read streams on an
    H100, docs/benchmarks/README.md); a new mask is new data, not new code (torch 2.13 on the
    CPU compiled it once for three masks of one shape).
    Compiled with static shapes, once per (batch, span) the engine captures: the
    dynamic form torch switches to after a second shape ran 14-22x slower on an H100 and failed
    to lower at a 1024-key span (docs/benchmarks/README.md, "Decode attention"). On CPU the
    eager form (every score materialized: the reference the tests use)."""
    if torch.cuda.is_available():
        compiled = torch.compile(_flex_one_query, dynamic=False)

        def run(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                block_mask) -> torch.Tensor:
            with torch._dynamo.config.patch(recompile_limit=FLEX_COMPILED_SHAPES):
                return compiled(q, keys, values, block_mask)

        return run
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile",
                            category=UserWarning)
    return _flex_one_query


def visible_blocks(attend: torch.Tensor, block: int = FLEX_KEY_BLOCK):
    """The FlexAttention block mask of one query per row that sees the keys ``attend``
    [B, 1, 1, T] marks: blocks a row sees wholly are read without a mask, blocks it sees in
    part with it, and the rest not at all. Built with tensor ops only (a CUDA graph can hold it)."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, length = attend.shape[0], attend.shape[-1]
    count = -(-length // block)
    visible = attend.reshape(batch, length)
    grouped = F.pad(visible, (0, count * block - length)).view(batch, count, block)
    seen, whole = grouped.any(dim=-1), grouped.all(dim=-1)
    partial = seen & ~whole

    def listed(wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~wanted).to(torch.int8), dim=-1, stable=True)  # wanted first
        return (wanted.sum(dim=-1).to(torch.int32)[:, None, None],
                order.to(torch.int32)[:, None, None, :])

    # The mask reads the unpadded mask: inductor failed to lower a padded one inside the kernel
    # (a span not a multiple of the block; H100, torch 2.11). Keys past ``length`` in the last
    # block are outside the keys FlexAttention attends, and its kernel bounds their indices.
    def mask_mod(b, h, q_index, kv_index):
        return visible[b, kv_index]

    partial_count, partial_index = listed(partial)
    whole_count, whole_index = listed(whole)
    return BlockMask.from_kv_blocks(partial_count, partial_index, whole_count, whole_index,
                                    BLOCK_SIZE=(128, block), mask_mod=mask_mod,
                                    seq_lengths=(1, length), compute_q_blocks=False)


def _flex_one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    block_mask) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, keys, values, block_mask=block_mask,
                          enable_gqa=q.shape[1] != keys.shape[1])


def flex_one_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             attend: torch.Tensor, block_mask=None) -> torch.Tensor:
    """Attention of one query per row (shapes as :func:`one_query_attention`) with
    FlexAttention over :func:`visible_blocks` of ``attend`` (or ``block_mask``, built from it
    already): a row reads only the key blocks it can see, not the whole span the batch shares."""
    return _flex_kernel()(q, keys, values,
                          visible_blocks(attend) if block_mask is None else block_mask)
